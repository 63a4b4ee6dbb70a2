// `smla run`: its options, the model and backend, then one of its two jobs: the attention ops alone (run_ops.cpp,
// the default) or the whole attention layer (run_layer.cpp, with --layer).
#include <charconv>
#include <cstdint>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "commands.h"
#include "run_job.h"
#include "smla/error.h"
#include "smla/explain.h"

namespace smla::cli {

Action add_run(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "run", "run decode steps of a model's attention ops (or, with --layer, its whole attention layer) on the chosen "
             "backend and report speed");
  auto o = std::make_shared<JobOptions>();
  add_common_options(*sub, o->common);
  sub->add_option("--batch", o->batch, "requests decoded together (one new token each per step)")->capture_default_str();
  sub->add_option("--context", o->context, "tokens already in each request's cache")->capture_default_str();
  sub->add_option("--steps", o->steps, "decode steps")->capture_default_str();
  sub->add_option("--seed", o->seed, "random seed (of the data, and of --layer's random weights)")
      ->capture_default_str()
      ->check(CLI::Validator(  // CLI11 would take -1 as 2^64 - 1 and saturate 2^64
          [](const std::string& text) {
            uint64_t value = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
            return ec == std::errc() && end == text.data() + text.size()
                       ? std::string()
                       : "expected an integer from 0 to 2^64 - 1, got " + text;
          },
          "UINT64"));
  auto* layer = sub->add_option("--layer", o->layer,
                                "run the whole attention layer N (projections, RoPE, caches, indexer, attention, "
                                "o_proj; with --tp, one rank's heads): random context rows, a prefill of --prompt "
                                "tokens, then the decode steps");
  sub->add_option("--weights", o->weights,
                  "with --layer: the layer's weights from a .gguf file (a split model's first part) or a folder of "
                  "safetensors shards with config.json (default: random weights of --model's geometry)")
      ->needs(layer);
  sub->add_option("--prompt", o->prompt, "with --layer: tokens of the timed prefill prompt")
      ->capture_default_str()
      ->needs(layer);
  return [sub, o]() -> int {
    if (!sub->parsed()) return -1;
    require(o->batch >= 1, "--batch: expected a positive integer, got " + std::to_string(o->batch));
    require(o->context >= 1, "--context: expected a positive integer, got " + std::to_string(o->context));
    require(o->steps >= 1, "--steps: expected a positive integer, got " + std::to_string(o->steps));
    o->layer_job = sub->count("--layer") > 0;
    o->model_given = sub->count("--model") > 0;
    // The ops job's decode step attends --batch query rows a call: the explanation names the kernel for them (a
    // batch beyond explain's bound is left to the job's own check, which names --batch).
    if (!o->layer_job && o->batch <= kMaxQueryTokens) o->common.run.query_tokens = {o->batch};
    const Resolved res = o->layer_job ? resolve_layer_job(*o) : resolve(o->common);
    const Selection sel = select(res.spec, res.run);
    if (!o->common.json) std::cout << explain_text(res.spec, res.run, sel) << "\n";
    if (!sel.chosen) {
      if (o->common.json) std::cout << explain_json(res.spec, res.run, sel);
      return 1;
    }
    if (res.run.device.is_cuda()) {  // --device sm_XY explains any GPU; running needs this one
      const Device here = detect_device();
      if (!here.is_cuda() || here.compute_capability != res.run.device.compute_capability)
        throw Error(ErrorKind::unsupported, "--device " + res.run.device.name() + ": this machine's device is " +
                                                here.name() + "; smla run runs on the device it is on (use --device auto)");
    }
    Memory mem(res.run.device);
    check_job_fits(*o, res, mem);
    try {
      return o->layer_job ? run_layer(*o, res, *sel.chosen, mem) : run_ops(*o, res, *sel.chosen, mem);
    } catch (const std::bad_alloc&) {  // what check_job_fits cannot foresee: the layer's own buffers
      throw Error(ErrorKind::internal, "out of host memory: the job's buffers do not fit this machine; lower " +
                                           std::string(o->layer_job ? "--batch, --context or --prompt"
                                                                    : "--batch or --context"));
    }
  };
}

}  // namespace smla::cli
