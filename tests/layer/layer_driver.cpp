// Runs MlaLayer on a checkpoint folder for tests/layer/test_hf_layer.py: DIR holds config.json, model.safetensors
// (layer 0) and hidden.f32 ([T, hidden_size] float32). One request: a prefill of the first PREFILL tokens, then
// one decode step per remaining token, on the CPU or (DEVICE cuda) on the first GPU. Writes DIR/out.f32
// ([T, hidden_size]).
//   layer_driver DIR PREFILL [absorbed|unabsorbed] [bfloat16|float16|fp8_ds_mla|fp8_ds_mla_nope] [cpu|cuda]
#ifdef SMLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "smla/error.h"
#include "smla/layer.h"

namespace {

// The layer's input and output rows where the layer runs: the host vectors themselves on the CPU, device copies on
// a GPU.
class Rows {
 public:
  Rows(std::vector<float>& hidden, std::vector<float>& out, bool on_gpu) : hidden_(hidden), out_(out) {
    if (!on_gpu) return;
#ifdef SMLA_WITH_CUDA
    const size_t bytes = hidden.size() * sizeof(float);
    check(cudaMalloc(&device_hidden_, bytes));
    check(cudaMalloc(&device_out_, bytes));
    check(cudaMemcpy(device_hidden_, hidden.data(), bytes, cudaMemcpyHostToDevice));
#endif
  }
  ~Rows() {
#ifdef SMLA_WITH_CUDA
    cudaFree(device_hidden_);
    cudaFree(device_out_);
#endif
  }
  const float* hidden(size_t row, int d) const { return (device_hidden_ ? device_hidden_ : hidden_.data()) + row * d; }
  float* out(size_t row, int d) { return (device_out_ ? device_out_ : out_.data()) + row * d; }
  // Brings the outputs to the host vector.
  void finish() {
#ifdef SMLA_WITH_CUDA
    if (device_out_)
      check(cudaMemcpy(out_.data(), device_out_, out_.size() * sizeof(float), cudaMemcpyDeviceToHost));
#endif
  }

 private:
#ifdef SMLA_WITH_CUDA
  static void check(cudaError_t e) { smla::require(e == cudaSuccess, std::string("CUDA: ") + cudaGetErrorString(e)); }
#endif
  std::vector<float>& hidden_;
  std::vector<float>& out_;
  float* device_hidden_ = nullptr;
  float* device_out_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: layer_driver DIR PREFILL [absorbed|unabsorbed] [kv cache dtype] [cpu|cuda]\n";
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int prefill = std::stoi(argv[2]);
    const bool unabsorbed = argc > 3 && std::string(argv[3]) == "unabsorbed";
    smla::LayerOptions options;
    if (argc > 4) options.kv_cache_dtype = smla::parse_dtype(argv[4]).value_or(smla::DType::u8);
    const std::string device = argc > 5 ? argv[5] : "cpu";
    smla::require(device == "cpu" || device == "cuda", "DEVICE: expected cpu or cuda, got " + device);
    if (device == "cuda") options.device = smla::Device::cuda(0);  // the layer reads the compute capability
    smla::MlaLayer layer(smla::load_attention_weights(dir, 0), options);
    const int d = layer.spec().hidden_size;

    std::ifstream in(dir + "/hidden.f32", std::ios::binary | std::ios::ate);
    smla::require(bool(in), dir + "/hidden.f32: cannot read");
    std::vector<float> hidden(size_t(in.tellg()) / sizeof(float)), out(hidden.size());
    in.seekg(0);
    in.read(reinterpret_cast<char*>(hidden.data()), std::streamsize(hidden.size() * sizeof(float)));
    const int tokens = int(hidden.size() / d);
    smla::require(prefill > 0 && prefill <= tokens, "PREFILL: expected 1.." + std::to_string(tokens));

    Rows rows(hidden, out, layer.device().is_cuda());
    const int request = layer.add_request();
    smla::LayerSegment seg{request, prefill};
    layer.forward({&seg, 1}, rows.hidden(0, d), rows.out(0, d),
                  unabsorbed ? smla::AttentionPath::unabsorbed : smla::AttentionPath::absorbed);
    seg.num_tokens = 1;
    for (int t = prefill; t < tokens; ++t) layer.forward({&seg, 1}, rows.hidden(t, d), rows.out(t, d));
    rows.finish();

    std::ofstream(dir + "/out.f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(out.data()), std::streamsize(out.size() * sizeof(float)));
  } catch (const std::exception& e) {
    std::cerr << "layer_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
