// Runs MlaLayer on a checkpoint folder for tests/layer/test_hf_layer.py: DIR holds config.json, model.safetensors
// (layer 0) and hidden.f32 ([T, hidden_size] float32). One request: a prefill of the first PREFILL tokens, then
// one decode step per remaining token. Writes DIR/out.f32 ([T, hidden_size]).
//   layer_driver DIR PREFILL [absorbed|unabsorbed] [bfloat16|float16|fp8_ds_mla]
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "smla/error.h"
#include "smla/layer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: layer_driver DIR PREFILL [absorbed|unabsorbed] [kv cache dtype]\n";
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int prefill = std::stoi(argv[2]);
    const bool unabsorbed = argc > 3 && std::string(argv[3]) == "unabsorbed";
    smla::LayerOptions options;
    if (argc > 4) options.kv_cache_dtype = smla::parse_dtype(argv[4]).value_or(smla::DType::u8);
    smla::MlaLayer layer(smla::load_attention_weights(dir, 0), options);
    const int d = layer.spec().hidden_size;

    std::ifstream in(dir + "/hidden.f32", std::ios::binary | std::ios::ate);
    smla::require(bool(in), dir + "/hidden.f32: cannot read");
    std::vector<float> hidden(size_t(in.tellg()) / sizeof(float)), out(hidden.size());
    in.seekg(0);
    in.read(reinterpret_cast<char*>(hidden.data()), std::streamsize(hidden.size() * sizeof(float)));
    const int tokens = int(hidden.size() / d);
    smla::require(prefill > 0 && prefill <= tokens, "PREFILL: expected 1.." + std::to_string(tokens));

    const int request = layer.add_request();
    smla::LayerSegment seg{request, prefill};
    layer.forward({&seg, 1}, hidden.data(), out.data(),
                  unabsorbed ? smla::AttentionPath::unabsorbed : smla::AttentionPath::absorbed);
    seg.num_tokens = 1;
    for (int t = prefill; t < tokens; ++t) layer.forward({&seg, 1}, &hidden[size_t(t) * d], &out[size_t(t) * d]);

    std::ofstream(dir + "/out.f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(out.data()), std::streamsize(out.size() * sizeof(float)));
  } catch (const std::exception& e) {
    std::cerr << "layer_driver: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
