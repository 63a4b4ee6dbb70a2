// Text for the one-line error messages about a GGUF file, shared by the
// reader (gguf.cpp), dequantisation (gguf_dequantize.cpp) and the attention
// geometry (gguf_spec.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/gguf.h"

namespace smla::gguf {

inline std::string num(uint64_t value) { return std::to_string(value); }

// Text from the file (a key, a tensor name), safe in a one-line message:
// quoted, non-printable bytes escaped, long text cut.
std::string printable(std::string_view text);

// A value, shown briefly: "u32 5", "string \"llama\"", "an array of 3 u32".
std::string describe(const Value& value);

}  // namespace smla::gguf
