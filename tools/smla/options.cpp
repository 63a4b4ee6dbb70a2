#include "options.h"

#include "smla/error.h"
#include "smla/spec.h"
#include "smla/types.h"

namespace smla::cli {

void add_common_options(CLI::App& app, CommonOptions& o) {
  std::string presets;  // from the presets themselves, so the help lists every one
  for (const std::string& name : preset_names()) presets += (presets.empty() ? "" : ", ") + name;
  app.add_option("--model", o.model, "preset name (" + presets + "), a config.json or its folder, or a .gguf file")
      ->capture_default_str();
  app.add_option("--device", o.run.device, "auto, cpu, cuda or cuda:N (this machine's GPU N), or a GPU architecture sm_80 / sm_86 / sm_89 / sm_90 / sm_100 / sm_120")
      ->capture_default_str();
  app.add_option("--dtype", o.run.dtype, "query dtype: bfloat16 or float16")->capture_default_str();
  app.add_option("--kv-cache-dtype", o.run.kv_cache_dtype,
                 "auto (= --dtype), " + dtype_names(kAllMlaCacheDTypes) +
                     " (fp8_ds_mla_nope: heads with no rope part; fp8_ds_mla_v4: DeepSeek-V4's)")
      ->capture_default_str();
  app.add_option("--block-size", o.run.block_size, "tokens per KV-cache block")->capture_default_str();
  app.add_option("--tp", o.run.tp, "tensor-parallel size (heads per rank = heads / tp)")->capture_default_str();
  app.add_option("--backend", o.run.backend, "force a backend by name (default: $SMLA_BACKEND, else choose)");
  app.add_flag("--json", o.json,
               "print JSON (explain: docs/explain-json.md; run: smla.run/1 in README.md; run --layer: docs/layer.md)");
}

Resolved resolve(const CommonOptions& o) { return resolve(o, load_model_spec(o.model)); }

Resolved resolve(const CommonOptions& o, AttentionSpec spec) {
  RunSpec run = make_run_spec(spec, o.run, OptionNames::cli);
  return {std::move(spec), std::move(run)};
}

}  // namespace smla::cli
