// The GGUF reader: memory mapping, parsing with bounds checks and split models. Dequantisation is in
// gguf_dequantize.cpp, the attention geometry from the metadata in gguf_spec.cpp. Layout facts from ggml's
// docs/gguf.md.
#include "models/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "models/gguf_text.h"
#include "smla/error.h"

namespace smla::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF data is read in place: little-endian hosts only");

std::string printable(std::string_view text) {
  constexpr size_t kShown = 80;
  std::string out = "\"";
  for (const unsigned char c : text.substr(0, kShown)) {
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    }
  }
  return out + (text.size() > kShown ? "...\"" : "\"");
}

std::string describe(const Value& value) {
  const std::string type(value_type_name(value.type));
  return std::visit(
      [&](const auto& v) -> std::string {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::string>) return "string " + printable(v);
        else if constexpr (std::is_same_v<V, ArrayInfo>)
          return "an array of " + num(v.count) + " " + std::string(value_type_name(v.element_type));
        else if constexpr (std::is_same_v<V, bool>) return std::string("bool ") + (v ? "true" : "false");
        else if constexpr (std::is_same_v<V, double>) {
          char text[32];
          const auto end = std::to_chars(text, text + sizeof text, v).ptr;
          return type + " " + std::string(text, end);
        } else return type + " " + std::to_string(v);
      },
      value.data);
}

namespace {

// Nested arrays are legal; the bound keeps a crafted file from exhausting the stack.
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;  // ggml's GGML_MAX_DIMS
constexpr uint64_t kMaxAlignment = uint64_t{1} << 30;

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// Little-endian reads from a cursor that never passes the end: each read checks the bytes left first.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const std::string& path) : bytes_(bytes), path_(path) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return bytes_.size() - pos_; }
  [[noreturn]] void reject(const std::string& what) const { fail(path_ + ": " + what); }

  void need(uint64_t n, std::string_view what) const {
    if (n > left())
      reject("truncated: " + std::string(what) + " needs " + num(n) + " bytes at offset " + num(pos_) +
             ", but only " + num(left()) + " are left");
  }

  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  void skip(uint64_t n, std::string_view what) {
    need(n, what);
    pos_ += n;
  }

  std::string_view read_string(std::string_view what) {
    const uint64_t length = read<uint64_t>(what);
    if (length > left())
      reject(std::string(what) + ": string length " + num(length) + " exceeds the " + num(left()) +
             " bytes left in the file");
    const std::string_view text(reinterpret_cast<const char*>(bytes_.data() + pos_), length);
    pos_ += length;
    return text;
  }

 private:
  std::span<const uint8_t> bytes_;
  const std::string& path_;
  uint64_t pos_ = 0;
};

constexpr uint32_t kValueTypes = 13;

uint64_t fixed_size(ValueType type) {
  switch (type) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: return 8;
    case ValueType::string: case ValueType::array: return 0;
  }
  return 0;
}

ValueType read_type(Reader& in, const std::string& what) {
  const uint32_t code = in.read<uint32_t>(what);
  if (code >= kValueTypes) in.reject(what + ": unknown value type " + num(code) + " (GGUF defines 0 to 12)");
  return static_cast<ValueType>(code);
}

bool read_bool(Reader& in, const std::string& what) {
  const uint8_t byte = in.read<uint8_t>(what);
  if (byte > 1) in.reject(what + ": a bool must be 0 or 1, got " + num(byte));
  return byte == 1;
}

ArrayInfo skip_array(Reader& in, const std::string& what, int depth) {
  if (depth > kMaxArrayDepth) in.reject(what + ": arrays nested more than " + num(kMaxArrayDepth) + " deep");
  const ValueType element = read_type(in, what + " (array element type)");
  const uint64_t count = in.read<uint64_t>(what + " (array length)");
  // Every element takes at least this many bytes, so the count is checked before any loop runs over it.
  const uint64_t min_size = element == ValueType::string ? 8 : element == ValueType::array ? 12 : fixed_size(element);
  if (count > in.left() / min_size)
    in.reject(what + ": an array of " + num(count) + " " + std::string(value_type_name(element)) +
              " values cannot fit in the " + num(in.left()) + " bytes left in the file");
  if (element == ValueType::boolean) {
    for (uint64_t i = 0; i < count; ++i) read_bool(in, what);
  } else if (element == ValueType::string) {
    for (uint64_t i = 0; i < count; ++i) in.read_string(what);
  } else if (element == ValueType::array) {
    for (uint64_t i = 0; i < count; ++i) skip_array(in, what, depth + 1);
  } else {
    in.skip(count * min_size, what);
  }
  return {element, count};
}

Value read_value(Reader& in, ValueType type, const std::string& what) {
  switch (type) {
    case ValueType::u8: return {type, uint64_t{in.read<uint8_t>(what)}};
    case ValueType::i8: return {type, int64_t{in.read<int8_t>(what)}};
    case ValueType::u16: return {type, uint64_t{in.read<uint16_t>(what)}};
    case ValueType::i16: return {type, int64_t{in.read<int16_t>(what)}};
    case ValueType::u32: return {type, uint64_t{in.read<uint32_t>(what)}};
    case ValueType::i32: return {type, int64_t{in.read<int32_t>(what)}};
    case ValueType::u64: return {type, in.read<uint64_t>(what)};
    case ValueType::i64: return {type, in.read<int64_t>(what)};
    case ValueType::f32: return {type, double{in.read<float>(what)}};
    case ValueType::f64: return {type, in.read<double>(what)};
    case ValueType::boolean: return {type, read_bool(in, what)};
    case ValueType::string: return {type, std::string(in.read_string(what))};
    case ValueType::array: return {type, skip_array(in, what, 1)};
  }
  in.reject(what + ": unknown value type");
}

// A non-negative integer value of any width; nullopt for anything else.
std::optional<uint64_t> as_unsigned(const Value& value) {
  if (const auto* u = std::get_if<uint64_t>(&value.data)) return *u;
  if (const auto* i = std::get_if<int64_t>(&value.data); i && *i >= 0) return static_cast<uint64_t>(*i);
  return std::nullopt;
}

uint64_t align_up(uint64_t offset, uint64_t alignment) { return (offset + alignment - 1) / alignment * alignment; }

uint64_t read_alignment(const File& file) {
  const Value* value = file.find("general.alignment");
  if (!value) return file.alignment;
  const std::optional<uint64_t> alignment = as_unsigned(*value);
  if (!alignment || !std::has_single_bit(*alignment) || *alignment > kMaxAlignment)
    fail(file.path + ": general.alignment: expected a power of two up to 2^30, got " + describe(*value));
  return *alignment;
}

void read_tensor_infos(Reader& in, uint64_t count, File& file, std::span<const uint8_t> bytes) {
  std::vector<uint64_t> sizes;
  file.tensors.reserve(count);  // count was checked against the bytes left
  sizes.reserve(count);
  std::unordered_set<std::string_view> names;
  for (uint64_t i = 0; i < count; ++i) {
    Tensor tensor;
    tensor.name = std::string(in.read_string("the name of tensor info " + num(i)));
    const std::string what = "tensor " + printable(tensor.name);
    const uint32_t n_dims = in.read<uint32_t>(what + " (dimension count)");
    if (n_dims > kMaxDims) in.reject(what + ": " + num(n_dims) + " dimensions, at most " + num(kMaxDims));
    for (uint32_t d = 0; d < n_dims; ++d) {
      tensor.dims.push_back(in.read<uint64_t>(what + " (dimensions)"));
      if (tensor.dims.back() > uint64_t{std::numeric_limits<int64_t>::max()})
        in.reject(what + ": dimension " + num(d) + " is " + num(tensor.dims.back()) + ", more than 2^63 - 1");
    }
    tensor.type = in.read<uint32_t>(what + " (type)");
    const TypeInfo* type = type_info(tensor.type);
    if (!type) in.reject(what + ": unknown ggml type " + num(tensor.type));
    tensor.offset = in.read<uint64_t>(what + " (offset)");
    if (tensor.offset % file.alignment != 0)
      in.reject(what + ": data offset " + num(tensor.offset) + " is not a multiple of the alignment " +
                num(file.alignment));
    const uint64_t row = tensor.dims.empty() ? 1 : tensor.dims[0];
    if (row % type->block_size != 0)
      in.reject(what + ": rows of " + num(row) + " values are not whole " + std::string(type->name) + " blocks of " +
                num(type->block_size));
    std::optional<uint64_t> size = checked_mul(row / type->block_size, type->type_size);
    for (size_t d = 1; d < tensor.dims.size() && size; ++d) size = checked_mul(*size, tensor.dims[d]);
    if (!size) in.reject(what + ": its size in bytes overflows 64 bits");
    sizes.push_back(*size);
    file.tensors.push_back(std::move(tensor));
    // The set views names inside the vector, which the reserve() above keeps in place.
    if (!names.insert(file.tensors.back().name).second)
      in.reject("tensor name " + printable(file.tensors.back().name) + " appears twice");
  }

  const uint64_t data_start = align_up(in.pos(), file.alignment);
  if (count > 0 && data_start > bytes.size())
    in.reject("the tensor data would start at offset " + num(data_start) + ", past the end of the file (" +
              num(bytes.size()) + " bytes)");
  const uint64_t data_size = bytes.size() - std::min<uint64_t>(data_start, bytes.size());
  std::vector<size_t> order(file.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) {
    Tensor& tensor = file.tensors[i];
    const uint64_t size = sizes[i];
    if (tensor.offset > data_size || size > data_size - tensor.offset)
      in.reject("tensor " + printable(tensor.name) + ": its " + num(size) + " bytes at data offset " +
                num(tensor.offset) + " run past the end of the file (the data section holds " + num(data_size) +
                " bytes)");
    tensor.offset += data_start;
    tensor.data = bytes.subspan(tensor.offset, size);
    order[i] = i;
  }
  std::ranges::sort(order, {}, [&](size_t i) { return file.tensors[i].offset; });
  const Tensor* previous = nullptr;
  for (const size_t i : order) {
    const Tensor& tensor = file.tensors[i];
    if (tensor.data.empty()) continue;  // an empty tensor overlaps nothing
    if (previous && previous->offset + previous->data.size() > tensor.offset)
      in.reject("tensors " + printable(previous->name) + " and " + printable(tensor.name) + " overlap (bytes " +
                num(previous->offset) + "-" + num(previous->offset + previous->data.size()) + " and " +
                num(tensor.offset) + "-" + num(tensor.offset + tensor.data.size()) + ")");
    previous = &tensor;
  }
}

// split.count / split.no of one part: an integer in [min, max]; nullopt when absent.
std::optional<uint64_t> split_key(const File& file, std::string_view key, uint64_t min, uint64_t max) {
  const Value* value = file.find(key);
  if (!value) return std::nullopt;
  const std::optional<uint64_t> number = as_unsigned(*value);
  if (!number || *number < min || *number > max)
    fail(file.path + ": " + std::string(key) + ": expected an integer from " + num(min) + " to " + num(max) +
         ", got " + describe(*value));
  return *number;
}

// The parts' names: "PREFIX-00001-of-00003.gguf" gives PREFIX, part 1 of 3.
struct SplitName {
  std::string prefix;
  uint64_t number;
  uint64_t total;
};

std::optional<SplitName> parse_split_name(const std::string& path) {
  constexpr std::string_view kTail = "-00000-of-00000.gguf";
  if (path.size() < kTail.size()) return std::nullopt;
  const std::string_view tail = std::string_view(path).substr(path.size() - kTail.size());
  for (size_t i = 0; i < kTail.size(); ++i) {
    const bool digit = kTail[i] == '0';
    if (digit != (std::isdigit(static_cast<unsigned char>(tail[i])) != 0) || (!digit && tail[i] != kTail[i]))
      return std::nullopt;
  }
  SplitName name{path.substr(0, path.size() - kTail.size()), 0, 0};
  std::from_chars(tail.data() + 1, tail.data() + 6, name.number);
  std::from_chars(tail.data() + 10, tail.data() + 15, name.total);
  return name;
}

std::string five_digits(uint64_t number) {
  char text[24];
  std::snprintf(text, sizeof text, "%05llu", static_cast<unsigned long long>(number));
  return text;
}

std::string part_path(const SplitName& name, uint64_t number) {
  return name.prefix + "-" + five_digits(number) + "-of-" + five_digits(name.total) + ".gguf";
}

std::optional<std::string> architecture(const File& file) {
  const Value* value = file.find("general.architecture");
  const std::string* name = value ? std::get_if<std::string>(&value->data) : nullptr;
  return name ? std::optional(*name) : std::nullopt;
}

}  // namespace

std::string_view value_type_name(ValueType type) {
  constexpr std::string_view kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                         "bool", "string", "array", "u64", "i64", "f64"};
  const auto index = static_cast<uint32_t>(type);
  return index < std::size(kNames) ? kNames[index] : "unknown";
}

const TypeInfo* type_info(uint32_t code) {
  static constexpr TypeInfo kTypes[] = {
      {0, "F32", 1, 4},         {1, "F16", 1, 2},        {2, "Q4_0", 32, 18},     {3, "Q4_1", 32, 20},
      {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},     {8, "Q8_0", 32, 34},     {9, "Q8_1", 32, 40},
      {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},  {12, "Q4_K", 256, 144},  {13, "Q5_K", 256, 176},
      {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},  {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
      {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},  {20, "IQ4_NL", 32, 18},  {21, "IQ3_S", 256, 110},
      {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},        {25, "I16", 1, 2},
      {26, "I32", 1, 4},        {27, "I64", 1, 8},       {28, "F64", 1, 8},       {29, "IQ1_M", 256, 56},
      {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},  {35, "TQ2_0", 256, 66},  {39, "MXFP4", 32, 17},
      {40, "NVFP4", 64, 36},    {41, "Q1_0", 128, 18},
  };
  const auto it = std::ranges::find(kTypes, code, &TypeInfo::code);
  return it == std::end(kTypes) ? nullptr : &*it;
}

uint64_t Tensor::count() const {
  uint64_t n = 1;
  // Cannot overflow: parse() checked that the bytes fit in the file, and no type packs 8 values into a byte.
  for (const uint64_t d : dims) n *= d;
  return n;
}

const Value* File::find(std::string_view key) const {
  const auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

// --- Memory mapping ------------------------------------------------------------------------------------------

MappedFile MappedFile::open(const std::string& path) {
  const auto io_error = [&](const std::string& what) {
    return Error(ErrorKind::io, path + ": cannot " + what + ": " + std::generic_category().message(errno));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("open");
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const Error error = io_error("stat");
    ::close(fd);
    throw error;
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    throw Error(ErrorKind::io, path + ": cannot read: not a regular file");
  }
  MappedFile file;
  file.path_ = path;
  file.size_ = static_cast<size_t>(info.st_size);
  if (file.size_ > 0) {  // mmap rejects an empty range; an empty file is simply no bytes
    void* data = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) {
      const Error error = io_error("map");
      ::close(fd);
      throw error;
    }
    file.data_ = static_cast<const uint8_t*>(data);
  }
  ::close(fd);  // the mapping keeps the file's pages
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { unmap(); }

void MappedFile::unmap() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

// --- Parsing -----------------------------------------------------------------------------------------------

File parse(std::span<const uint8_t> bytes, const std::string& path) {
  File file;
  file.path = path;
  Reader in(bytes, file.path);
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "GGUF", 4) != 0)
    in.reject("not a GGUF file: it does not start with the magic \"GGUF\"");
  in.skip(4, "the magic");
  file.version = in.read<uint32_t>("the version");
  if (file.version == 0x02000000u || file.version == 0x03000000u)
    throw Error(ErrorKind::unsupported, path + ": a big-endian GGUF file; smla reads little-endian ones");
  if (file.version != 2 && file.version != 3)
    in.reject("GGUF version " + num(file.version) + " is not supported (expected 2 or 3)");
  const uint64_t tensor_count = in.read<uint64_t>("the tensor count");
  const uint64_t kv_count = in.read<uint64_t>("the metadata count");
  // Smallest entries: a metadata pair is a key length, a type and one byte; a tensor info a name length, a
  // dimension count, a type and an offset.
  constexpr uint64_t kMinPair = 8 + 4 + 1, kMinTensorInfo = 8 + 4 + 4 + 8;
  if (kv_count > in.left() / kMinPair)
    in.reject("header: " + num(kv_count) + " metadata entries cannot fit in the " + num(in.left()) +
              " bytes left in the file");
  if (tensor_count > (in.left() - kv_count * kMinPair) / kMinTensorInfo)
    in.reject("header: " + num(tensor_count) + " tensors cannot fit in the " + num(in.left()) +
              " bytes left in the file");

  for (uint64_t i = 0; i < kv_count; ++i) {
    const std::string key(in.read_string("the key of metadata entry " + num(i)));
    const std::string what = "metadata " + printable(key);
    const ValueType type = read_type(in, what);
    Value value = read_value(in, type, what);
    if (!file.metadata.emplace(key, std::move(value)).second)
      in.reject("metadata key " + printable(key) + " appears twice");
  }
  file.alignment = read_alignment(file);
  read_tensor_infos(in, tensor_count, file, bytes);
  return file;
}

// --- Split models --------------------------------------------------------------------------------------------

Model Model::open(const std::string& path) {
  Model model;
  model.maps_.push_back(MappedFile::open(path));
  model.parts_.push_back(parse(model.maps_.back().bytes(), path));

  constexpr uint64_t kMaxParts = 99999;  // the names carry five digits
  const uint64_t count = split_key(model.parts_[0], "split.count", 1, kMaxParts).value_or(1);
  const uint64_t first_no = split_key(model.parts_[0], "split.no", 0, count - 1).value_or(0);
  if (first_no != 0)
    fail(path + ": this is part " + num(first_no + 1) + " of " + num(count) + " of a split model (split.no = " +
         num(first_no) + "); open the first part, PREFIX-00001-of-" + five_digits(count) + ".gguf");
  if (count > 1) {
    const std::optional<SplitName> name = parse_split_name(path);
    if (!name || name->number != 1 || name->total != count)
      fail(path + ": a split model of " + num(count) + " parts (split.count) must be opened by its first part, " +
           "named PREFIX-00001-of-" + five_digits(count) + ".gguf");
    const auto shown = [](std::optional<uint64_t> value) { return value ? num(*value) : std::string("missing"); };
    const std::optional<std::string> arch = architecture(model.parts_[0]);
    for (uint64_t i = 1; i < count; ++i) {
      const std::string part = part_path(*name, i + 1);
      std::error_code ignored;
      if (!std::filesystem::exists(part, ignored))
        throw Error(ErrorKind::io, path + ": part " + num(i + 1) + " of " + num(count) + " is missing: " + part);
      model.maps_.push_back(MappedFile::open(part));
      model.parts_.push_back(parse(model.maps_.back().bytes(), part));
      const File& file = model.parts_.back();
      if (const std::optional<uint64_t> n = split_key(file, "split.count", 0, kMaxParts); n != count)
        fail(part + ": split.count is " + shown(n) + ", but the first part says " + num(count));
      if (const std::optional<uint64_t> no = split_key(file, "split.no", 0, kMaxParts); no != i)
        fail(part + ": split.no is " + shown(no) + ", expected " + num(i) + " for part " + num(i + 1) + " of " +
             num(count));
      if (const std::optional<std::string> other = architecture(file); other && arch && *other != *arch)
        fail(part + ": general.architecture is " + printable(*other) + ", but the first part says " + printable(*arch));
    }
  }

  uint64_t total = 0;
  for (size_t p = 0; p < model.parts_.size(); ++p) {
    for (Tensor& tensor : model.parts_[p].tensors) {
      tensor.part = p;
      if (!model.tensors_.emplace(tensor.name, &tensor).second)
        fail(model.parts_[p].path + ": tensor " + printable(tensor.name) + " is also in another part");
      ++total;
    }
  }
  if (count > 1) {
    const Value* declared = model.parts_[0].find("split.tensors.count");
    if (declared && as_unsigned(*declared) != total)
      fail(path + ": split.tensors.count is " + describe(*declared) + ", but the " + num(count) + " parts hold " +
           num(total) + " tensors");
  }
  return model;
}

const Tensor* Model::find_tensor(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

}  // namespace smla::gguf
