// The one exception type smla throws. Its message is one line that names the
// argument or field at fault and what was expected.
#pragma once

#include <stdexcept>
#include <string>

namespace smla {

enum class ErrorKind {
  invalid_argument,  // bad input: a tensor, a value, a config field, a flag
  unsupported,       // valid input that no backend (or the forced one) can run
  io,                // a file that cannot be read
  internal,          // a failure inside a backend (e.g. a CUDA runtime error)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void fail(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

// Throws an invalid_argument Error with `message` unless `condition` holds.
inline void require(bool condition, const std::string& message) {
  if (!condition) fail(message);
}
// The same for a literal message: its std::string is made only on failure (ops call require on every call; a
// message built from parts is built on every call too: write `if (!condition) fail(...)` for those).
inline void require(bool condition, const char* message) {
  if (!condition) fail(message);
}

}  // namespace smla
