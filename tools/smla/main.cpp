// The smla command-line tool. Exit status: 0 success, 1 no valid backend (or
// a forced backend that cannot run), 2 bad usage or input, 3 internal error.
#include <iostream>

#include "commands.h"
#include "smla/error.h"

int main(int argc, char** argv) {
  CLI::App app{"smla: Multi-head Latent Attention and DeepSeek Sparse Attention on CPUs and NVIDIA GPUs"};
  app.require_subcommand(1);
  std::vector<smla::cli::Action> actions = {smla::cli::add_run(app), smla::cli::add_explain(app), smla::cli::add_backends(app)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help and version exit 0 through CLI11; every other parse error is bad usage.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    app.exit(e);
    return 2;
  }
  try {
    for (auto& act : actions)
      if (int rc = act(); rc >= 0) return rc;
    return 2;
  } catch (const smla::Error& e) {
    std::cerr << "smla: error: " << e.what() << "\n";
    switch (e.kind()) {
      case smla::ErrorKind::invalid_argument:
      case smla::ErrorKind::io: return 2;
      case smla::ErrorKind::unsupported: return 1;
      case smla::ErrorKind::internal: return 3;
    }
  } catch (const std::exception& e) {
    std::cerr << "smla: internal error: " << e.what() << "\n";
  }
  return 3;
}
