// Backend registry and explainable selection.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "smla/backend.h"

namespace smla {

class Registry {
 public:
  // The process-wide registry holding every backend compiled into this build.
  static Registry& global();

  void add(std::unique_ptr<Backend> backend);
  const Backend* find(std::string_view name) const;
  std::vector<const Backend*> all() const;
  std::vector<std::string> names() const;
  // Backends in the order select() tries them on `device`: the device kind's
  // priority list first, then any other backend (each shown, most rejected).
  std::vector<const Backend*> priority(const Device& device) const;

  // Priority lists: backend names, best first, per device kind.
  void set_priority(DeviceKind kind, std::vector<std::string> names);

  // The first backend in `kind`'s priority order that runs on that kind (null: none), the one an op runs on when
  // given none. Kept by add() and set_priority(), so that an op call looks nothing up by name.
  const Backend* default_backend(DeviceKind kind) const {
    return kind == DeviceKind::cpu ? cpu_default_ : cuda_default_;
  }

 private:
  void update_defaults();

  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::string> cpu_priority_, cuda_priority_;
  const Backend* cpu_default_ = nullptr;
  const Backend* cuda_default_ = nullptr;
};

struct Candidate {
  const Backend* backend = nullptr;
  std::vector<std::string> reasons;  // empty: valid
  bool valid() const { return reasons.empty(); }
};

struct Selection {
  const Backend* chosen = nullptr;  // null when none is valid
  bool forced = false;              // chosen by --backend / SMLA_BACKEND / the API
  std::vector<Candidate> candidates;  // every backend, in priority order
  // When none is valid: the smallest change to the run that makes one valid,
  // e.g. "use --kv-cache-dtype bfloat16 (backend cpu)". Empty when none found.
  std::string suggestion;
};

// Walks the device's priority list and takes the first valid backend. A
// backend forced by name (run.backend, else the SMLA_BACKEND environment
// variable) is chosen if valid; forcing an invalid one throws smla::Error
// (unsupported) listing its reasons, an unknown name throws (invalid_argument)
// listing the valid names. When nothing is valid the Selection has no choice
// and a suggestion; it does not throw.
Selection select(const AttentionSpec& spec, const RunSpec& run, const Registry& registry = Registry::global());

// select() that throws smla::Error (unsupported) with every candidate's
// reasons and the suggestion when no backend is valid.
const Backend& select_backend(const AttentionSpec& spec, const RunSpec& run,
                              const Registry& registry = Registry::global());

// The default backend for tensors on `device` (used by the ops when no
// backend is passed): the first registered backend of that device kind that
// can run on it. Throws smla::Error if there is none.
const Backend& backend_for(const Device& device, const Registry& registry = Registry::global());

// The device of the current machine: the first CUDA GPU when the CUDA
// runtime finds one (and CUDA backends were built), else the CPU.
Device detect_device();

// The most query rows per call RunOptions::query_tokens takes (a bound on input, not on the ops).
inline constexpr int64_t kMaxQueryTokens = int64_t{1} << 24;
// A run described in words, as a user gives it (CLI flags, Python keyword arguments).
struct RunOptions {
  std::string device = "auto";          // auto | cpu | sm_XY | cuda[:N]
  std::string dtype = "bfloat16";       // bfloat16 | float16
  // auto (= dtype) | bfloat16 | float16 | fp8_ds_mla | fp8_ds_mla_nope | fp8_ds_mla_v4
  std::string kv_cache_dtype = "auto";
  int block_size = 64;
  int tp = 1;
  std::string backend;  // empty: choose (SMLA_BACKEND still applies)
  bool attn_sink = false;
  // Query rows per call (tokens) to show the attention kernel for (explain); empty: 1 and 4096.
  std::vector<int64_t> query_tokens;
};
// How errors name the options: "--kv-cache-dtype" (cli) or "kv_cache_dtype" (python).
enum class OptionNames { cli, python };
// The RunSpec for `spec` those words describe. Throws smla::Error
// (invalid_argument) naming the option at fault, including a tp that does not
// divide the model's heads.
RunSpec make_run_spec(const AttentionSpec& spec, const RunOptions& options, OptionNames names = OptionNames::python);

}  // namespace smla
