// Hugging Face safetensors, read in place from memory maps: a file is an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the data. Every range is checked against the file.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "models/gguf.h"
#include "smla/weights.h"

namespace smla::safetensors {

struct Tensor {
  std::string dtype;  // "BF16", "F32", ...
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;
};

// One parsed file, with views into bytes the caller keeps alive.
struct File {
  std::string path;
  std::map<std::string, Tensor, std::less<>> tensors;
};

File parse(std::span<const uint8_t> bytes, const std::string& path);

// The values as float32 from F32, F16 or BF16; other dtypes throw an unsupported Error naming the file and tensor.
std::vector<float> to_float(const Tensor& tensor, std::string_view name, const std::string& path);

// A checkpoint folder: model.safetensors.index.json and the shards it names, or a single model.safetensors.
// Shards are mapped when a tensor in them is first read.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& dir);

  // The tensor as float32; nullopt when the checkpoint has no tensor of that name.
  std::optional<WeightTensor> read(std::string_view name);
  // Whether the checkpoint lists a tensor of that name (reads no values).
  bool contains(std::string_view name);
  // The file that lists the tensors (the index, or the single file), for messages.
  const std::string& listing() const { return listing_; }

 private:
  const File& shard(const std::string& file_name);

  std::string dir_;
  bool indexed_ = false;
  std::string listing_;
  std::map<std::string, std::string, std::less<>> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::pair<gguf::MappedFile, File>, std::less<>> shards_;
};

}  // namespace smla::safetensors
