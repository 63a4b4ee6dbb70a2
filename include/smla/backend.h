// Backends describe what they can run once, as data (Capabilities); the
// selector, `smla explain`, the README's support matrix and the tests all read
// that one declaration.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "smla/ops.h"
#include "smla/spec.h"
#include "smla/types.h"

namespace smla {

struct IntRange {
  int min = 0;
  int max = 0;
  bool contains(int v) const { return v >= min && v <= max; }
};

// The kernel a backend runs for `query_tokens` query rows a call, as explain reports it: its name and shape (the
// CUDA backend: its attention kernel's heads per CTA, warps, pipeline depth, dynamic shared memory and resident CTAs
// per SM on the run's arch), and every other kernel with why it was not chosen.
struct KernelChoice {
  int64_t query_tokens = 0;
  std::string phase;   // "decode" (1 row) or "prefill" (4096) where explain picked the rows; empty where the run named them
  std::string kernel;  // e.g. "wgmma kernel"; "none" where no kernel can run
  std::string arch;    // the arch the choice was made for, e.g. "sm_90a"
  int heads_per_cta = 0, warps = 0, stages = 0, smem_bytes = 0, ctas_per_sm = 0;
  std::string shape;   // the kernel's shape in words: "8 heads/CTA, 12 warps, depth 3, keys on M, ..."
  struct Other {
    std::string kernel, reason;
  };
  std::vector<Other> others;
};

struct Capabilities {
  std::string name;         // what --backend and SMLA_BACKEND take
  std::string description;  // one line for `explain`
  DeviceKind device_kind = DeviceKind::cpu;
  IntRange compute_capability{0, 0};  // CUDA only, major*10+minor, inclusive
  std::vector<DType> q_dtypes;
  std::vector<DType> kv_cache_dtypes;
  IntRange heads{1, 1};          // heads per rank
  std::vector<int> head_counts;  // when non-empty, only these head counts
  std::vector<int> qk_head_dims{kMlaQkDim};  // absorbed head size: 576 (rope 64), 512 (no rope part)
  std::vector<int> v_head_dims{kMlaVDim};
  IntRange block_size{1, 1};
  int block_size_multiple = 1;
  IntRange topk{1, 1};
  int topk_multiple = 1;
  OpSet ops;
  bool pooled_indexer = false;  // the indexer also for index_kpool > 1 (GLM-5.3-Flash)
  // Sparse attention over two caches under one softmax: DeepSeek-V4's window cache and its compressed (extra) cache,
  // each with its own block size, block table and top-k length (FlashMLA's extra_k_cache).
  bool extra_cache = false;
  bool attn_sink = false;
  // Anything the fields above cannot express; returns reasons (empty: fine).
  std::function<std::vector<std::string>(const AttentionSpec&, const RunSpec&)> combination_rule;
  // What `explain` reports under the backend when chosen: the kernels it runs for the run's query rows per call
  // (RunSpec::query_tokens) and why not the others (empty or unset: nothing).
  std::function<std::vector<KernelChoice>(const AttentionSpec&, const RunSpec&)> kernel_choices;
};

// Why `caps` cannot run `spec` under `run`, one human-readable line per
// problem. Empty means the backend is valid.
std::vector<std::string> validate(const Capabilities& caps, const AttentionSpec& spec, const RunSpec& run);

// A backend: its declaration and its ops. Args arrive checked (smla::check).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const Capabilities& capabilities() const = 0;
  const std::string& name() const { return capabilities().name; }

  virtual void write_mla_cache(const WriteMlaCacheArgs& args) const = 0;
  virtual void sparse_mla(const SparseMlaArgs& args) const = 0;
  virtual void paged_mla_decode(const PagedMlaDecodeArgs& args) const = 0;
  virtual void write_index_cache(const WriteIndexCacheArgs& args) const = 0;
  virtual void indexer_topk(const IndexerTopkArgs& args) const = 0;
  virtual void positions_to_slots(const PositionsToSlotsArgs& args) const = 0;
  // The pooled indexer's ops (Capabilities::pooled_indexer). Default: unsupported, an smla::Error.
  virtual void write_pooled_index_cache(const WritePooledIndexCacheArgs& args) const;
  virtual void pools_to_positions(const PoolsToPositionsArgs& args) const;
  virtual void rotate_index_q(const RotateIndexQArgs& args) const;
  // Default: the three ops in sequence on this backend.
  virtual void dsa_decode_step(const DsaDecodeStepArgs& args) const;

  // Bytes of scratch each op needs for these (checked) args; the ops get at
  // least that much in `workspace`, or, when absent, find their own.
  // Default: none. dsa_decode_step's steps run one after another, so they
  // share one workspace: the default is the largest of theirs.
  virtual size_t workspace_size(const SparseMlaArgs&) const { return 0; }
  virtual size_t workspace_size(const PagedMlaDecodeArgs&) const { return 0; }
  virtual size_t workspace_size(const IndexerTopkArgs&) const { return 0; }
  virtual size_t workspace_size(const DsaDecodeStepArgs& args) const;
};

}  // namespace smla
