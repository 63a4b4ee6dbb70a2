// `smla backends`: every backend's declared capabilities, as a Markdown table.
#include <iostream>

#include "commands.h"
#include "smla/explain.h"

namespace smla::cli {

Action add_backends(CLI::App& app) {
  auto* sub = app.add_subcommand("backends", "list every backend and what it declares it can run");
  return [sub]() -> int {
    if (!sub->parsed()) return -1;
    std::cout << support_matrix_markdown();
    return 0;
  };
}

}  // namespace smla::cli
