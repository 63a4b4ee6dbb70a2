// The complete MLA / DSA attention layer of deepseek_v3, deepseek_v32, glm_moe_dsa and glm5_next models, on the
// CPU or on a CUDA GPU: hidden states in, attention output (after o_proj) out, for a batch of requests that each
// own blocks of a paged cache. docs/layer.md describes the math, the paths, the devices and the numerics.
#pragma once

#include <memory>
#include <span>

#include "smla/backend.h"
#include "smla/weights.h"

namespace smla {

// The dtype of the layer's attention query: the cache's 16-bit type, f16 beside an f16 cache, else bf16 (the fp8
// cache's rope part is bf16).
constexpr DType attention_query_dtype(DType kv_cache_dtype) {
  return kv_cache_dtype == DType::f16 ? DType::f16 : DType::bf16;
}

struct LayerOptions {
  int num_blocks = 256;                   // paged cache capacity, shared by all requests
  int block_size = 64;                    // a multiple of index_kpool for a pooled indexer
  DType kv_cache_dtype = DType::bf16;     // bf16, f16 or fp8_ds_mla; also fp8_ds_mla_nope without a rope part
  DType index_cache_dtype = DType::bf16;  // bf16 or fp8_e4m3 (DSA models)
  int max_chunk_tokens = 256;             // tokens per pass: bounds the buffers of long prompts
  // Where the layer runs. On a CUDA device (Device::cuda(compute_capability or 0, index)) the weights are held in
  // bf16 and the caches in that GPU's memory, and forward's and append_context's arrays are device pointers.
  Device device = Device::cpu();
  // CUDA device only: the cudaStream_t every call runs on (null: the default stream); it must outlive the layer.
  void* stream = nullptr;
  const Backend* backend = nullptr;  // null: the backend select() chooses for the spec on `device` and these cache
                                     // dtypes; else one that runs on `device` and can run the spec
};

// The tokens of one request in a forward call; they are appended to its context in order.
struct LayerSegment {
  int request = 0;
  int num_tokens = 0;
};

enum class AttentionPath {
  absorbed,    // W_UK folded into the query, W_UV into the output, attention through the smla ops
  unabsorbed,  // k_nope and v expanded through kv_b, standard causal attention (new prompts only; DSA only
               // while the prompt fits in top-k, where it is exact)
};

// Seconds spent per phase, summed over forward calls. On a GPU, asking for a profile makes forward wait for the
// device at every phase boundary (so each phase is charged its own kernels); without one, forward only enqueues work.
struct LayerProfile {
  double projections = 0;  // q / kv projections, norms, absorbing W_UK
  double rope = 0;
  double cache_write = 0;  // write_mla_cache (and write_index_cache)
  double indexer = 0;      // indexer projections, norm and RoPE
  double topk = 0;         // indexer_topk and positions_to_slots (and the indexer query to bf16)
  double attention = 0;    // sparse_mla / paged_mla_decode (and the query to 16 bits), or the unabsorbed attention
  double output = 0;       // W_UV and o_proj
};

class MlaLayer {
 public:
  // Checks every tensor's shape against weights.spec (smla::Error naming the tensor), that the spec fits the
  // kernels (kv_lora_rank 512, qk_rope_head_dim 64 or 0, index_head_dim 128; a pooled indexer with its tail always
  // selected) and the options (smla::Error naming the
  // option: a CUDA device in a build without CUDA or absent from the machine, a backend for another device or that
  // cannot run the spec, a cache dtype). Weights stay float32 on the CPU and are converted to bf16 once on a GPU.
  MlaLayer(AttentionWeights weights, const LayerOptions& options = {});
  ~MlaLayer();
  MlaLayer(MlaLayer&&) noexcept;
  MlaLayer& operator=(MlaLayer&&) noexcept;

  const AttentionSpec& spec() const;
  // The device the layer runs on (a CUDA device with its compute capability) and the backend its ops run on.
  Device device() const;
  const Backend& backend() const;
  // A new request with an empty context; returns its id.
  int add_request();
  // Gives the request's blocks back to the pool; its id is not reused.
  void release_request(int request);
  int context_length(int request) const;
  int free_blocks() const;

  // Appends `tokens` positions whose cache rows were computed elsewhere (an imported prefix, a benchmark's context):
  // latent [tokens, 512] (normed c), k_pe [tokens, 64] (null without a rope part) and, for DSA models, index_k
  // [tokens, 128] (after RoPE and the norm; for a pooled indexer [tokens, 256]: the key after the norm, then the
  // gate scores x @ index_kpool_compress_gate^T), all f32 in the layer's device memory. Throws smla::Error,
  // changing nothing, when the pool has too few blocks.
  void append_context(int request, int tokens, const float* latent, const float* k_pe, const float* index_k);

  // hidden: [Σ num_tokens, hidden_size] f32, the segments' rows in order; out: the same shape; both in the layer's
  // device memory (device pointers on a GPU, where forward returns once the work is enqueued on options.stream).
  // The blocks every segment needs are taken before anything is computed: when the pool has too few, smla::Error
  // and no change. The unabsorbed path runs on the CPU only (smla::Error on a GPU).
  void forward(std::span<const LayerSegment> segments, const float* hidden, float* out,
               AttentionPath path = AttentionPath::absorbed, LayerProfile* profile = nullptr);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace smla
