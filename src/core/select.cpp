#include "smla/select.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <numeric>

#include "core/machine.h"
#include "smla/error.h"

namespace smla {

// Registry::global() and detect_device() are defined with the backends (src/registry.cpp).

void Registry::add(std::unique_ptr<Backend> backend) {
  if (find(backend->name()))
    throw Error(ErrorKind::internal, "backend '" + backend->name() + "' is registered twice");
  backends_.push_back(std::move(backend));
  update_defaults();
}

const Backend* Registry::find(std::string_view name) const {
  for (const auto& b : backends_)
    if (b->name() == name) return b.get();
  return nullptr;
}

std::vector<const Backend*> Registry::all() const {
  std::vector<const Backend*> out;
  for (const auto& b : backends_) out.push_back(b.get());
  return out;
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& b : backends_) out.push_back(b->name());
  return out;
}

void Registry::set_priority(DeviceKind kind, std::vector<std::string> names) {
  (kind == DeviceKind::cpu ? cpu_priority_ : cuda_priority_) = std::move(names);
  update_defaults();
}

void Registry::update_defaults() {
  auto first = [&](DeviceKind kind) -> const Backend* {
    for (const Backend* b : priority(kind == DeviceKind::cpu ? Device::cpu() : Device::cuda(0)))
      if (b->capabilities().device_kind == kind) return b;
    return nullptr;
  };
  cpu_default_ = first(DeviceKind::cpu);
  cuda_default_ = first(DeviceKind::cuda);
}

std::vector<const Backend*> Registry::priority(const Device& device) const {
  std::vector<const Backend*> out;
  for (const auto& name : device.is_cpu() ? cpu_priority_ : cuda_priority_)
    if (const Backend* b = find(name)) out.push_back(b);
  for (const auto& b : backends_)
    if (std::find(out.begin(), out.end(), b.get()) == out.end()) out.push_back(b.get());
  return out;
}

namespace {

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s;
}

std::string join_reasons(const std::vector<std::string>& reasons) {
  std::string s;
  for (size_t i = 0; i < reasons.size(); ++i) s += (i ? "; " : "") + reasons[i];
  return s;
}

// Kinds of change to a run, cheapest first.
enum class ChangeKind { kv_cache_dtype, q_dtype, block_size, tp, device };

// One change to the run, as a user would type it, and the run it gives.
struct Change {
  ChangeKind kind;
  std::string flag;
  RunSpec run;
};

// Single changes to the run that could make `caps` valid, cheapest first:
// cache dtype, query dtype, block size, tensor parallelism, then the device.
std::vector<Change> candidate_changes(const Capabilities& caps, const AttentionSpec& spec, const RunSpec& run) {
  std::vector<Change> out;
  auto with = [&](ChangeKind kind, std::string flag, const std::function<void(RunSpec&)>& edit) {
    RunSpec r = run;
    edit(r);
    out.push_back({kind, std::move(flag), std::move(r)});
  };
  // Cache dtypes of the asked one's kind first (an fp8 cache asked for: another fp8 layout, e.g. DeepSeek-V4's, before
  // a 16-bit cache of twice the bytes), each kind in the backend's order.
  const auto fp8 = [](DType d) { return is_fp8_mla_cache(d) || d == DType::fp8_ds_mla_v4; };
  std::vector<DType> kvs = caps.kv_cache_dtypes;
  std::stable_partition(kvs.begin(), kvs.end(), [&](DType d) { return fp8(d) == fp8(run.resolved_kv_cache_dtype()); });
  for (DType kv : kvs)
    if (kv != run.resolved_kv_cache_dtype())
      with(ChangeKind::kv_cache_dtype, "--kv-cache-dtype " + std::string(dtype_name(kv)), [&](RunSpec& r) { r.kv_cache_dtype = kv; });
  for (DType q : caps.q_dtypes)
    if (q != run.q_dtype)
      with(ChangeKind::q_dtype, "--dtype " + std::string(dtype_name(q)), [&](RunSpec& r) { r.q_dtype = q; });
  // The smallest supported block size that is >= the current one, else the largest; with a pooled indexer, a
  // multiple of its pool size too.
  int mult = std::max(caps.block_size_multiple, 1);
  if (spec.indexer && spec.indexer->kpool > 1) mult = std::lcm(mult, spec.indexer->kpool);
  int bs = std::max(run.block_size, caps.block_size.min);
  bs = (bs + mult - 1) / mult * mult;
  if (bs > caps.block_size.max) bs = caps.block_size.max / mult * mult;
  if (bs != run.block_size && bs >= 1)
    with(ChangeKind::block_size, "--block-size " + std::to_string(bs), [&](RunSpec& r) { r.block_size = bs; });
  // Tensor-parallel sizes that divide the heads, nearest to the current one first.
  std::vector<int> tps;
  for (int tp = 1; tp <= spec.num_heads; ++tp)
    if (spec.num_heads % tp == 0 && tp != run.tp) tps.push_back(tp);
  std::stable_sort(tps.begin(), tps.end(), [&](int a, int b) { return std::abs(a - run.tp) < std::abs(b - run.tp); });
  for (int tp : tps) with(ChangeKind::tp, "--tp " + std::to_string(tp), [&](RunSpec& r) { r.tp = tp; });
  if (caps.device_kind == DeviceKind::cpu && !run.device.is_cpu())
    with(ChangeKind::device, "--device cpu", [&](RunSpec& r) { r.device = Device::cpu(); });
  return out;
}

// The cheapest kind of change that makes some backend valid; among changes of
// that kind, the one for the backend highest in the priority order.
std::string smallest_change(const std::vector<const Backend*>& order, const AttentionSpec& spec, const RunSpec& run) {
  const Change* best = nullptr;
  const Backend* best_backend = nullptr;
  std::vector<std::vector<Change>> changes;
  changes.reserve(order.size());
  for (const Backend* b : order) {
    changes.push_back(candidate_changes(b->capabilities(), spec, run));
    for (const Change& c : changes.back()) {
      if (best && c.kind >= best->kind) break;
      if (validate(b->capabilities(), spec, c.run).empty()) {
        best = &c;
        best_backend = b;
        break;
      }
    }
  }
  return best ? "use " + best->flag + " (backend " + best_backend->name() + " would then be valid)" : std::string();
}

}  // namespace

Selection select(const AttentionSpec& spec, const RunSpec& run, const Registry& registry) {
  validate(spec, run);
  std::string forced = run.backend;
  if (forced.empty())
    if (const char* env = std::getenv("SMLA_BACKEND")) forced = env;

  Selection sel;
  const auto order = registry.priority(run.device);
  for (const Backend* b : order) sel.candidates.push_back({b, validate(b->capabilities(), spec, run)});

  if (!forced.empty()) {
    const Backend* b = registry.find(forced);
    if (!b)
      fail("backend: unknown backend '" + forced + "' (from " + (run.backend.empty() ? "SMLA_BACKEND" : "--backend") +
           "); valid names: " + join_names(registry.names()));
    auto it = std::find_if(sel.candidates.begin(), sel.candidates.end(), [&](auto& c) { return c.backend == b; });
    if (!it->valid())
      throw Error(ErrorKind::unsupported, "backend '" + forced + "' was forced but cannot run " + spec.name + " on " +
                                              run.device.name() + ": " + join_reasons(it->reasons));
    sel.chosen = b;
    sel.forced = true;
    return sel;
  }
  for (const auto& c : sel.candidates)
    if (c.valid()) {
      sel.chosen = c.backend;
      return sel;
    }
  sel.suggestion = smallest_change(order, spec, run);
  return sel;
}

const Backend& select_backend(const AttentionSpec& spec, const RunSpec& run, const Registry& registry) {
  Selection sel = select(spec, run, registry);
  if (sel.chosen) return *sel.chosen;
  std::string msg = "no valid attention backend for " + spec.name + " on " + run.device.name() + ":";
  for (const auto& c : sel.candidates) msg += " [" + c.backend->name() + ": " + join_reasons(c.reasons) + "]";
  if (!sel.suggestion.empty()) msg += "; " + sel.suggestion;
  throw Error(ErrorKind::unsupported, msg);
}

const Backend& backend_for(const Device& device, const Registry& registry) {
  if (const Backend* b = registry.default_backend(device.kind)) return *b;
  throw Error(ErrorKind::unsupported, "no backend in this build runs on " + device.name() +
                                          (device.is_cuda() ? " (was smla built without CUDA?)" : ""));
}

namespace {
// "cuda" / "cuda:N" name a GPU of this machine: its compute capability, or an error saying there is none.
Device this_machines_gpu(const Device& wanted, std::string_view text, bool cli) {
  const std::string flag = std::string(cli ? "--device " : "device='") + std::string(text) + (cli ? "" : "'");
  const std::string instead = "; use " + std::string(cli ? "--device cpu" : "device='cpu'") +
                              " to run on the CPU, or an architecture (" + (cli ? "--device sm_90" : "device='sm_90'") +
                              ", ...) to explain a run on another machine's GPU";
#ifdef SMLA_WITH_CUDA
  if (auto d = machine_cuda_device(wanted.index)) return *d;
  if (detect_device().is_cuda()) fail(flag + ": this machine has no CUDA GPU " + std::to_string(wanted.index) + instead);
  fail(flag + ": this machine has no CUDA GPU (or no driver for one)" + instead);
#else
  fail(flag + ": this build of smla has no CUDA support (built without nvcc)" + instead);
#endif
}
}  // namespace

RunSpec make_run_spec(const AttentionSpec& spec, const RunOptions& o, OptionNames names) {
  const bool cli = names == OptionNames::cli;
  auto name = [&](const char* python, const char* flag) { return std::string(cli ? flag : python) + ": "; };
  // A spec edited after loading (from Python, say) is checked as a loaded one is.
  validate(spec, spec.name.empty() ? "spec" : spec.name);
  RunSpec run;
  run.device = o.device == "auto" ? detect_device() : parse_device(o.device, cli ? "--device" : "device");
  if (run.device.is_cuda() && run.device.compute_capability == 0)
    run.device = this_machines_gpu(run.device, o.device, cli);
  const auto q = parse_dtype(o.dtype);
  require(q == DType::bf16 || q == DType::f16,
          name("dtype", "--dtype") + "expected bfloat16 or float16, got '" + o.dtype + "'");
  run.q_dtype = *q;
  if (o.kv_cache_dtype != "auto") {
    const auto kv = parse_dtype(o.kv_cache_dtype);
    require(kv && is_mla_cache_dtype(*kv), name("kv_cache_dtype", "--kv-cache-dtype") + "expected auto, " +
                                              dtype_names(kAllMlaCacheDTypes) + ", got '" + o.kv_cache_dtype + "'");
    run.kv_cache_dtype = *kv;
  }
  require(o.block_size >= 1,
          name("block_size", "--block-size") + "expected a positive integer, got " + std::to_string(o.block_size));
  require(o.tp >= 1, name("tp", "--tp") + "expected a positive integer, got " + std::to_string(o.tp));
  run.block_size = o.block_size;
  run.tp = o.tp;
  run.backend = o.backend;
  run.attn_sink = o.attn_sink;
  for (int64_t t : o.query_tokens)
    require(t >= 1 && t <= kMaxQueryTokens, name("tokens", "--tokens") +
                                                "expected query rows per call from 1 to " +
                                                std::to_string(kMaxQueryTokens) + ", got " + std::to_string(t));
  run.query_tokens = o.query_tokens;
  heads_per_rank(spec, run);  // a tp that does not divide the heads is bad input
  return run;
}

}  // namespace smla
