// Options shared by the subcommands that describe a run (explain, run).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "smla/spec.h"

namespace smla::cli {

struct RunOptions {
  std::string model = "glm-5";
  std::string device = "auto";
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  int block_size = 64;
  int tp = 1;
  std::string backend;
  bool json = false;
};

void add_run_options(CLI::App& app, RunOptions& o);

struct Resolved {
  AttentionSpec spec;
  RunSpec run;
};
// Loads the model and builds the RunSpec; throws smla::Error naming the flag.
Resolved resolve(const RunOptions& o);

}  // namespace smla::cli
