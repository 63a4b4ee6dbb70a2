// libFuzzer target: bytes through the GGUF parser, the geometry from its metadata, and the dequantisation of every
// tensor. An smla::Error is the expected answer to bad input; anything else escaping, a sanitizer report, a leak or
// a hang is a bug.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "models/gguf.h"
#include "smla/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "fuzz.gguf";
  smla::gguf::File file;
  try {
    file = smla::gguf::parse(std::span(data, size), path);
  } catch (const smla::Error&) {
    return 0;
  }
  try {
    smla::gguf::spec_from_gguf(file);
  } catch (const smla::Error&) {
  }
  for (const smla::gguf::Tensor& tensor : file.tensors) {
    try {
      smla::gguf::dequantize(tensor, path);
    } catch (const smla::Error&) {
    }
  }
  return 0;
}
