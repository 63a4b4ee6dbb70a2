// Text helpers the library's name lookups share (dtype names, preset names, model types, file extensions).
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace smla {

// `text` in ASCII lower case (other bytes as they are): names are matched case-insensitively.
inline std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace smla
