// GGUF (versions 2 and 3), read in place from memory-mapped files. Every count, length and offset is checked
// against the bytes actually there before it is used, so a damaged or hostile file gives one smla::Error line
// naming the file and what is wrong, never a crash or an allocation sized by an unchecked number.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "smla/spec.h"

namespace smla::gguf {

// A whole file mapped read-only; the mapping lives as long as the object (moving it keeps the addresses).
// The safetensors reader maps its shards with it too.
class MappedFile {
 public:
  // Throws an io Error naming the path when the file cannot be opened or mapped.
  static MappedFile open(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  void unmap();
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

enum class ValueType : uint32_t { u8, i8, u16, i16, u32, i32, f32, boolean, string, array, u64, i64, f64 };
std::string_view value_type_name(ValueType type);

struct ArrayInfo {  // arrays are checked and skipped, not kept: smla reads no array-valued key
  ValueType element_type;
  uint64_t count;
};

struct Value {
  ValueType type;
  // Unsigned integers as uint64_t, signed as int64_t, f32 and f64 as double (f32 exactly), bool, string, array.
  std::variant<uint64_t, int64_t, double, bool, std::string, ArrayInfo> data;
};

// ggml's tensor types: a code, a name and the block layout (block_size values in type_size bytes).
struct TypeInfo {
  uint32_t code;
  std::string_view name;
  uint32_t block_size;
  uint32_t type_size;
};
// nullptr for a code the format does not define.
const TypeInfo* type_info(uint32_t code);

struct Tensor {
  std::string name;
  uint32_t type;                // a code type_info() knows
  std::vector<uint64_t> dims;   // ggml's ne: dims[0] varies fastest (a [out, in] matrix has dims {in, out})
  uint64_t offset;              // of the data, from the start of its file
  std::span<const uint8_t> data;
  size_t part = 0;              // which file of a split model holds it

  uint64_t count() const;  // elements
};

// One parsed file, with views into bytes the caller keeps alive.
struct File {
  std::string path;
  uint32_t version = 0;
  uint64_t alignment = 32;
  std::map<std::string, Value, std::less<>> metadata;
  std::vector<Tensor> tensors;

  const Value* find(std::string_view key) const;
};

// Parses (and checks) GGUF bytes; `path` names them in errors.
File parse(std::span<const uint8_t> bytes, const std::string& path);

// A model: one file, or all the parts of a split one (NAME-00001-of-00003.gguf ...) opened as one.
class Model {
 public:
  // `path` is the file, or the first part of a split model; the other parts are found by name next to it.
  static Model open(const std::string& path);

  const File& metadata() const { return parts_.front(); }  // model metadata lives in the first part
  const std::vector<File>& parts() const { return parts_; }
  const Tensor* find_tensor(std::string_view name) const;  // nullptr when no part holds it

 private:
  std::vector<MappedFile> maps_;
  std::vector<File> parts_;
  std::map<std::string, const Tensor*, std::less<>> tensors_;
};

// The tensor's values as float32: F32, F16, BF16, Q8_0, Q4_K and Q6_K, bit for bit what gguf-py's dequantize
// gives. Other types throw an unsupported Error naming `path`, the tensor and its type.
std::vector<float> dequantize(const Tensor& tensor, const std::string& path);

// The attention geometry from the metadata of a deepseek2, deepseek32 or glm-dsa file (docs/models.md has the key
// mapping). Errors name the file and the key.
AttentionSpec spec_from_gguf(const File& file);
AttentionSpec spec_from_gguf_file(const std::string& path);

}  // namespace smla::gguf
