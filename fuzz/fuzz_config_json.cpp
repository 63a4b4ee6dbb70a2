// libFuzzer target: bytes through the config.json reader. An smla::Error is the expected answer to bad input;
// anything else escaping (an nlohmann exception included), a sanitizer report, a leak or a hang is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "smla/error.h"
#include "smla/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    smla::spec_from_config_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json");
  } catch (const smla::Error&) {
  }
  return 0;
}
