// The safetensors reader: header checks, dtype conversion, and checkpoint folders with an index of shards.
#include "models/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/numeric.h"
#include "smla/error.h"

namespace smla::safetensors {
namespace {

using nlohmann::json;

// The format's own readers refuse larger headers; so does this one, before parsing anything.
constexpr uint64_t kMaxHeader = uint64_t{100} << 20;

std::string num(uint64_t value) { return std::to_string(value); }

// nlohmann's what() without its "[json.exception.parse_error.101] " tag, kept to one short line.
std::string json_message(const json::exception& error) {
  std::string text = error.what();
  if (const size_t tag_end = text.find("] "); text.starts_with("[json.exception.") && tag_end != std::string::npos)
    text.erase(0, tag_end + 2);
  std::ranges::replace(text, '\n', ' ');
  return text.size() > 160 ? text.substr(0, 157) + "..." : text;
}

json parse_json(std::span<const uint8_t> bytes, const std::string& path, std::string_view what) {
  try {
    return json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& error) {
    fail(path + ": " + std::string(what) + ": not valid JSON (" + json_message(error) + ")");
  }
}

// A name from the file, quoted and cut for a one-line message (the JSON dump escapes control characters).
std::string printable(std::string_view name) {
  std::string text = json(std::string(name)).dump(-1, ' ', true);
  return text.size() > 80 ? text.substr(0, 76) + "...\"" : text;
}

uint64_t dtype_size(std::string_view dtype) {
  constexpr std::pair<std::string_view, uint64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  const auto it = std::ranges::find(kSizes, dtype, &std::pair<std::string_view, uint64_t>::first);
  return it == std::end(kSizes) ? 0 : it->second;
}

// A non-negative JSON integer; nullopt for anything else.
std::optional<uint64_t> unsigned_value(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return static_cast<uint64_t>(value.get<int64_t>());
  return std::nullopt;
}

struct Range {
  uint64_t begin, end;
  const std::string* name;
};

Tensor read_entry(const std::string& name, const json& entry, std::span<const uint8_t> data, const std::string& path,
                  Range& range) {
  const std::string what = path + ": tensor " + printable(name);
  if (!entry.is_object()) fail(what + ": expected an object with dtype, shape and data_offsets");
  Tensor tensor;
  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) fail(what + ": dtype: expected a string");
  tensor.dtype = dtype->get<std::string>();
  const uint64_t element_size = dtype_size(tensor.dtype);
  if (element_size == 0) fail(what + ": unknown dtype " + printable(tensor.dtype));

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) fail(what + ": shape: expected an array of sizes");
  uint64_t bytes = element_size;
  bool overflow = false;
  for (const json& dim : *shape) {
    const std::optional<uint64_t> size = unsigned_value(dim);
    if (!size || *size > uint64_t{std::numeric_limits<int64_t>::max()})
      fail(what + ": shape: expected non-negative integers, got " + dim.dump());
    tensor.shape.push_back(static_cast<int64_t>(*size));
    overflow = overflow || __builtin_mul_overflow(bytes, *size, &bytes);
  }

  const auto offsets = entry.find("data_offsets");
  std::optional<uint64_t> begin, end;
  if (offsets != entry.end() && offsets->is_array() && offsets->size() == 2) {
    begin = unsigned_value((*offsets)[0]);
    end = unsigned_value((*offsets)[1]);
  }
  if (!begin || !end || *begin > *end) fail(what + ": data_offsets: expected [begin, end] with begin <= end");
  if (*end > data.size())
    fail(what + ": data_offsets [" + num(*begin) + ", " + num(*end) + "] run past the end of the data (" +
         num(data.size()) + " bytes)");
  if (overflow || *end - *begin != bytes)
    fail(what + ": data_offsets span " + num(*end - *begin) + " bytes, but a " + tensor.dtype + " tensor of shape " +
         shape->dump() + " takes " + (overflow ? std::string("more than 2^64") : num(bytes)));
  tensor.data = data.subspan(*begin, *end - *begin);
  range = {*begin, *end, nullptr};
  return tensor;
}

}  // namespace

File parse(std::span<const uint8_t> bytes, const std::string& path) {
  File file;
  file.path = path;
  if (bytes.size() < 8) fail(path + ": truncated: a safetensors file starts with an 8-byte header length");
  uint64_t header_size;
  std::memcpy(&header_size, bytes.data(), 8);
  if (header_size > bytes.size() - 8 || header_size > kMaxHeader)
    fail(path + ": header length " + num(header_size) + " exceeds the file (" + num(bytes.size()) +
         " bytes) or the 100 MiB limit");
  const json header = parse_json(bytes.subspan(8, header_size), path, "header");
  if (!header.is_object()) fail(path + ": header: expected a JSON object");
  const std::span<const uint8_t> data = bytes.subspan(8 + header_size);

  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;  // free-form strings
    Range range{};
    Tensor tensor = read_entry(name, entry, data, path, range);
    const auto placed = file.tensors.emplace(name, std::move(tensor));
    range.name = &placed.first->first;
    ranges.push_back(range);
  }
  std::ranges::sort(ranges, {}, &Range::begin);
  const Range* previous = nullptr;
  for (const Range& range : ranges) {
    if (range.begin == range.end) continue;  // an empty tensor overlaps nothing
    if (previous && previous->end > range.begin)
      fail(path + ": tensors " + printable(*previous->name) + " and " + printable(*range.name) + " overlap");
    previous = &range;
  }
  return file;
}

std::vector<float> to_float(const Tensor& tensor, std::string_view name, const std::string& path) {
  const size_t count = tensor.data.size() / dtype_size(tensor.dtype);
  std::vector<float> out(count);
  const auto convert = [&](float (*to_float)(uint16_t)) {
    for (size_t i = 0; i < count; ++i) {
      uint16_t bits;
      std::memcpy(&bits, tensor.data.data() + 2 * i, 2);
      out[i] = to_float(bits);
    }
  };
  if (tensor.dtype == "F32") {
    if (count > 0) std::memcpy(out.data(), tensor.data.data(), tensor.data.size());
  } else if (tensor.dtype == "BF16") {
    convert(numeric::bf16_to_float);
  } else if (tensor.dtype == "F16") {
    convert(numeric::f16_to_float);
  } else {
    throw Error(ErrorKind::unsupported, path + ": tensor " + printable(name) + " has dtype " + tensor.dtype +
                                            ", which smla cannot read (it reads BF16, F16 and F32)");
  }
  return out;
}

// --- Checkpoint folders --------------------------------------------------------------------------------------

Checkpoint Checkpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint checkpoint;
  checkpoint.dir_ = dir;
  std::error_code ignored;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index, ignored)) {
    checkpoint.indexed_ = true;
    checkpoint.listing_ = index.string();
    const gguf::MappedFile file = gguf::MappedFile::open(checkpoint.listing_);
    const json root = parse_json(file.bytes(), checkpoint.listing_, "index");
    const auto map = root.is_object() ? root.find("weight_map") : root.end();
    if (map == root.end() || !map->is_object())
      fail(checkpoint.listing_ + ": weight_map: expected an object of tensor name -> shard file");
    for (const auto& [name, shard] : map->items()) {
      // Shards are plain file names next to the index; anything else could reach outside the folder.
      const std::string file_name = shard.is_string() ? shard.get<std::string>() : "";
      if (file_name.empty() || file_name == "." || file_name == ".." ||
          file_name.find_first_of("/\\") != std::string::npos)
        fail(checkpoint.listing_ + ": weight_map: " + printable(name) + ": expected a shard file name, got " +
             shard.dump(-1, ' ', true).substr(0, 80));
      checkpoint.weight_map_.emplace(name, file_name);
    }
  } else if (fs::exists(single, ignored)) {
    checkpoint.listing_ = single.string();
  } else {
    throw Error(ErrorKind::io, dir + ": holds neither model.safetensors.index.json nor model.safetensors");
  }
  return checkpoint;
}

const File& Checkpoint::shard(const std::string& file_name) {
  if (const auto it = shards_.find(file_name); it != shards_.end()) return it->second.second;
  const std::string path = (std::filesystem::path(dir_) / file_name).string();
  gguf::MappedFile mapped = gguf::MappedFile::open(path);
  File parsed = parse(mapped.bytes(), path);
  return shards_.emplace(file_name, std::pair(std::move(mapped), std::move(parsed))).first->second.second;
}

bool Checkpoint::contains(std::string_view name) {
  if (indexed_) return weight_map_.contains(name);
  return shard("model.safetensors").tensors.contains(name);
}

std::optional<WeightTensor> Checkpoint::read(std::string_view name) {
  std::string file_name = "model.safetensors";
  if (indexed_) {
    const auto it = weight_map_.find(name);
    if (it == weight_map_.end()) return std::nullopt;
    file_name = it->second;
  }
  const File& file = shard(file_name);
  const auto it = file.tensors.find(name);
  if (it == file.tensors.end()) {
    if (!indexed_) return std::nullopt;
    fail(file.path + ": no tensor " + printable(name) + ", which " + listing_ + " places in it");
  }
  return WeightTensor{it->second.shape, to_float(it->second, name, file.path)};
}

}  // namespace smla::safetensors
