// The interface between the CPU attention driver (mla_attention.cpp) and its
// per-ISA kernels (attention_kernels.cpp). The driver resolves indices, block
// tables and validity into a list of row pointers per work item; the kernels
// only do arithmetic on those rows, so they never see an invalid index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "cpu/isa.h"
#include "smla/types.h"

namespace smla::cpu::attn {

// Heads are processed in register blocks of 4; buffers hold padded_heads rows.
inline constexpr int kHeadBlock = 4;
inline constexpr int padded_heads(int heads) { return (heads + kHeadBlock - 1) / kHeadBlock * kHeadBlock; }
inline constexpr int kMaxHeads = 128;
// A token's rows are split over at most this many work items.
inline constexpr int kMaxSplits = 16;

// One work item: the heads of one query token against n_rows cache rows.
// Produces the unnormalised output acc[h][512] = sum_i exp(s_i - m[h]) c_i,
// the running max m[h] of the scaled scores and l[h] = sum_i exp(s_i - m[h]).
// No rows: acc = 0, m = -inf, l = 0.
struct AttendJob {
  const void* q = nullptr;  // head h, dim d at q[h * q_head_stride + d]
  int64_t q_head_stride = 0;
  DType q_dtype = DType::bf16;
  int heads = 0;
  MlaHead head;  // q and the rows are head.qk_dim() wide (in the fp8 forms: the latent, then the rope part if any)
  DType cache_dtype = DType::bf16;
  const uint8_t* const* rows = nullptr;  // n_rows pointers to valid cache rows
  int64_t n_rows = 0;
  float scale = 0.f;
  float* acc = nullptr;  // [padded_heads][512]
  float* m = nullptr;    // [padded_heads]
  float* l = nullptr;    // [padded_heads]
  void* workspace = nullptr;  // Kernels::workspace_bytes(heads) bytes, 64-byte aligned
};

// Combines the n_parts partial results (AttendJob outputs over disjoint row
// sets) of heads [h_begin, h_end) of one token, applies the sink and writes
// out, lse and (when given) max_logits. A head with no rows gets out = 0,
// lse = empty_lse and max_logits = -inf.
struct FinalizeJob {
  const float* acc = nullptr;  // part p, head h: acc + p * part_stride + h * 512
  const float* m = nullptr;    // m[p * part_stride + h]
  const float* l = nullptr;
  int64_t part_stride = 0;
  int n_parts = 1;
  int h_begin = 0, h_end = 0;
  const float* sink = nullptr;  // optional [H]
  void* out = nullptr;          // head h at out + h * out_head_stride elements
  int64_t out_head_stride = 0;
  DType out_dtype = DType::bf16;
  float* lse = nullptr;  // head h at lse[h * lse_head_stride]
  int64_t lse_head_stride = 0;
  float empty_lse = 0.f;        // -inf, or +inf (FlashMLA's convention)
  float* max_logits = nullptr;  // optional, head h at max_logits[h * max_logits_head_stride]
  int64_t max_logits_head_stride = 0;
};

struct Kernels {
  std::string_view name;
  size_t (*workspace_bytes)(int heads);
  void (*attend)(const AttendJob&);
  void (*finalize)(const FinalizeJob&);
};

// The kernels for active_isa() (cpu/isa.h).
const Kernels& active_kernels();

}  // namespace smla::cpu::attn
