#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace smla::cli {

// Each subcommand registers its options and returns the action that runs it
// (returning the process exit status).
using Action = std::function<int()>;
Action add_explain(CLI::App& app);
Action add_backends(CLI::App& app);
Action add_run(CLI::App& app);

}  // namespace smla::cli
