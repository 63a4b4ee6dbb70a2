// `smla explain`: the model's geometry, every backend with its reasons, the choice.
#include <iostream>
#include <memory>

#include "commands.h"
#include "options.h"
#include "smla/explain.h"

namespace smla::cli {

Action add_explain(CLI::App& app) {
  auto* sub = app.add_subcommand("explain", "show which backend runs a model on a device, and why the others cannot");
  auto opts = std::make_shared<CommonOptions>();
  add_common_options(*sub, *opts);
  sub->add_option("--tokens", opts->run.query_tokens,
                  "query rows per call to show the CUDA attention kernel for, e.g. 1,8,4096 (default: 1 and 4096)")
      ->delimiter(',');
  return [sub, opts]() -> int {
    if (!sub->parsed()) return -1;
    const Resolved r = resolve(*opts);
    const Selection sel = select(r.spec, r.run);
    std::cout << (opts->json ? explain_json(r.spec, r.run, sel) : explain_text(r.spec, r.run, sel));
    return sel.chosen ? 0 : 1;
  };
}

}  // namespace smla::cli
