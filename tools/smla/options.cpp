#include "options.h"

#include "smla/error.h"
#include "smla/select.h"

namespace smla::cli {

void add_run_options(CLI::App& app, RunOptions& o) {
  app.add_option("--model", o.model, "preset name (glm-5, deepseek-v3.2, deepseek-v3, kimi-k2, glm-4.7-flash) or config.json")
      ->capture_default_str();
  app.add_option("--device", o.device, "auto, cpu, or a GPU architecture sm_80 / sm_86 / sm_89 / sm_90 / sm_100 / sm_120")
      ->capture_default_str();
  app.add_option("--dtype", o.dtype, "query dtype: bfloat16 or float16")->capture_default_str();
  app.add_option("--kv-cache-dtype", o.kv_cache_dtype, "auto (= --dtype), bfloat16, float16 or fp8_ds_mla")
      ->capture_default_str();
  app.add_option("--block-size", o.block_size, "tokens per KV-cache block")->capture_default_str();
  app.add_option("--tp", o.tp, "tensor-parallel size (heads per rank = heads / tp)")->capture_default_str();
  app.add_option("--backend", o.backend, "force a backend by name (default: $SMLA_BACKEND, else choose)");
  app.add_flag("--json", o.json, "print JSON (schema: docs/explain-json.md)");
}

Resolved resolve(const RunOptions& o) {
  Resolved r{load_model_spec(o.model), {}};
  r.run.device = o.device == "auto" ? detect_device() : parse_device(o.device, "--device");
  auto dtype = parse_dtype(o.dtype);
  require(dtype == DType::bf16 || dtype == DType::f16, "--dtype: expected bfloat16 or float16, got '" + o.dtype + "'");
  r.run.q_dtype = *dtype;
  if (o.kv_cache_dtype != "auto") {
    auto kv = parse_dtype(o.kv_cache_dtype);
    require(kv == DType::bf16 || kv == DType::f16 || kv == DType::fp8_ds_mla,
            "--kv-cache-dtype: expected auto, bfloat16, float16 or fp8_ds_mla, got '" + o.kv_cache_dtype + "'");
    r.run.kv_cache_dtype = *kv;
  }
  require(o.block_size >= 1, "--block-size: expected a positive integer, got " + std::to_string(o.block_size));
  require(o.tp >= 1, "--tp: expected a positive integer, got " + std::to_string(o.tp));
  r.run.block_size = o.block_size;
  r.run.tp = o.tp;
  r.run.backend = o.backend;
  heads_per_rank(r.spec, r.run);  // a tp that does not divide the heads is bad input
  return r;
}

}  // namespace smla::cli
