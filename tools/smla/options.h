// Options shared by the subcommands that describe a run (explain, run).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "smla/select.h"

namespace smla::cli {

// What explain and run share: the model, the run in words, JSON output.
struct CommonOptions {
  std::string model = "glm-5";
  RunOptions run;
  bool json = false;
};

void add_common_options(CLI::App& app, CommonOptions& o);

struct Resolved {
  AttentionSpec spec;
  RunSpec run;
};
// Loads the model and builds the RunSpec; throws smla::Error naming the flag.
Resolved resolve(const CommonOptions& o);
// The RunSpec of the options for a model given otherwise (smla run --weights).
Resolved resolve(const CommonOptions& o, AttentionSpec spec);

}  // namespace smla::cli
