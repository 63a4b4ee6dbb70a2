// The GGUF reader: memory mapping, parsing with bounds checks, split models, dequantisation and the attention
// geometry from the metadata. Layout facts from ggml's docs/gguf.md; block layouts from gguf-py's quants.py.
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
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <system_error>
#include <unordered_set>
#include <utility>

#include "core/numeric.h"
#include "smla/error.h"

namespace smla::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF data is read in place: little-endian hosts only");

namespace {

// Nested arrays are legal; the bound keeps a crafted file from exhausting the stack.
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;  // ggml's GGML_MAX_DIMS
constexpr uint64_t kMaxAlignment = uint64_t{1} << 30;

std::string num(uint64_t value) { return std::to_string(value); }

// Text from the file (a key, a tensor name), safe in a one-line message: quoted, non-printable bytes escaped,
// long text cut.
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

// A value, shown briefly for an error message: "u32 5", "string \"llama\"", "an array of 3 u32".
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

// --- Dequantisation ------------------------------------------------------------------------------------------
// Each formula keeps gguf-py's order of float32 operations, so the results match it bit for bit.

namespace {

template <typename T>
T load(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

float load_f16(const uint8_t* p) { return numeric::f16_to_float(load<uint16_t>(p)); }

// Q8_0: an f16 scale, then 32 int8 values.
void dequantize_q8_0(const uint8_t* block, float* out) {
  const float d = load_f16(block);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(block[2 + i])) * d;
}

// Q4_K: f16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit values. Sub-block s (32 values)
// takes the low nibbles of bytes [32 (s/2), +32) for even s and the high nibbles for odd s.
void dequantize_q4_k(const uint8_t* block, float* out) {
  const float d = load_f16(block);
  const float dmin = load_f16(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* qs = block + 16;
  for (int s = 0; s < 8; ++s) {
    uint8_t scale, min;
    if (s < 4) {
      scale = scales[s] & 63;
      min = scales[s + 4] & 63;
    } else {  // low 4 bits from bytes 8-11, high 2 from the top of bytes 0-3 (scales) or 4-7 (mins)
      scale = static_cast<uint8_t>((scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4));
      min = static_cast<uint8_t>((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
    }
    const float ds = d * static_cast<float>(scale);
    const float dm = dmin * static_cast<float>(min);
    const int shift = 4 * (s % 2);
    for (int i = 0; i < 32; ++i) {
      const auto q = static_cast<float>((qs[32 * (s / 2) + i] >> shift) & 0xF);
      out[32 * s + i] = ds * q - dm;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales (one per 16 values), f16 d.
// Value e of half h = e / 128 (w = e % 128): low nibble of ql[64 h + w % 64] (high nibble when w >= 64), high bits
// (qh[32 h + w % 32] >> 2 (w / 32)) & 3, minus 32.
void dequantize_q6_k(const uint8_t* block, float* out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = load_f16(block + 208);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, w = e % 128;
    const int low = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0xF;
    const int high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
    const float scale = d * static_cast<float>(scales[e / 16]);
    out[e] = scale * static_cast<float>((low | (high << 4)) - 32);
  }
}

}  // namespace

std::vector<float> dequantize(const Tensor& tensor, const std::string& path) {
  const TypeInfo* type = type_info(tensor.type);
  const uint64_t count = tensor.count();
  const auto blocks = [&](uint32_t block_size, uint32_t type_size, void (*decode)(const uint8_t*, float*)) {
    std::vector<float> out(count);
    for (uint64_t b = 0; b < count / block_size; ++b)
      decode(tensor.data.data() + b * type_size, out.data() + b * block_size);
    return out;
  };
  switch (tensor.type) {
    case 0: {  // F32
      std::vector<float> out(count);
      if (count > 0) std::memcpy(out.data(), tensor.data.data(), tensor.data.size());
      return out;
    }
    case 1: return blocks(1, 2, [](const uint8_t* in, float* out) { *out = load_f16(in); });
    case 30:
      return blocks(1, 2, [](const uint8_t* in, float* out) { *out = numeric::bf16_to_float(load<uint16_t>(in)); });
    case 8: return blocks(32, 34, dequantize_q8_0);
    case 12: return blocks(256, 144, dequantize_q4_k);
    case 14: return blocks(256, 210, dequantize_q6_k);
    default:
      throw Error(ErrorKind::unsupported,
                  path + ": tensor " + printable(tensor.name) + " has type " + std::string(type ? type->name : "?") +
                      ", which smla cannot dequantise (it reads F32, F16, BF16, Q8_0, Q4_K and Q6_K)");
  }
}

// --- The attention geometry -------------------------------------------------------------------------------------

namespace {

struct Architecture {
  std::string_view name;
  std::string_view model_type;
  bool sparse;
  RopeStyle indexer_rope;  // GGUF has no key for it: DeepSeek-V3.2 rotates half-split, GLM-5 interleaved
};
constexpr Architecture kArchitectures[] = {
    {"deepseek2", "deepseek_v3", false, RopeStyle::half_split},
    {"deepseek32", "deepseek_v32", true, RopeStyle::half_split},
    {"glm-dsa", "glm_moe_dsa", true, RopeStyle::interleaved},
};

// A float read back as the shortest decimal that rounds to it (for f32: 1e-6 stays the double 1e-6 a config.json
// holds, not 9.99999997e-7), times 10^shift applied to the decimal exponent so that no rounding creeps in.
double decimal(const Value& value, int shift) {
  const double stored = std::get<double>(value.data);
  char text[64];
  const std::to_chars_result printed =
      value.type == ValueType::f32
          ? std::to_chars(text, text + sizeof text, static_cast<float>(stored), std::chars_format::scientific)
          : std::to_chars(text, text + sizeof text, stored, std::chars_format::scientific);
  const std::string_view digits(text, printed.ptr);
  const size_t e = digits.find('e');
  int exponent = 0;
  std::from_chars(digits.data() + e + 1 + (digits[e + 1] == '+'), digits.data() + digits.size(), exponent);
  const std::string shifted = std::string(digits.substr(0, e)) + "e" + std::to_string(exponent + shift);
  double result = 0;
  std::from_chars(shifted.data(), shifted.data() + shifted.size(), result);
  return result;
}

// The metadata of one file, read with messages "<path>: <key>: <what was expected>, got <what>".
class Metadata {
 public:
  explicit Metadata(const File& file) : file_(file) {}

  [[noreturn]] void reject(std::string_view key, std::string_view expected, const std::string& got) const {
    fail(file_.path + ": " + std::string(key) + ": " + std::string(expected) + ", got " + got);
  }
  const Value* find(std::string_view key) const { return file_.find(key); }

  template <typename Int>
  std::optional<Int> integer(std::string_view key, Int min) const {
    const Value* value = find(key);
    if (!value) return std::nullopt;
    constexpr Int kMax = std::numeric_limits<Int>::max();
    const std::string expected = "expected an integer from " + std::to_string(min) + " to " + std::to_string(kMax);
    if (const auto* u = std::get_if<uint64_t>(&value->data); u && *u <= static_cast<uint64_t>(kMax) &&
                                                              static_cast<Int>(*u) >= min)
      return static_cast<Int>(*u);
    if (const auto* i = std::get_if<int64_t>(&value->data); i && *i >= min && *i <= kMax) return static_cast<Int>(*i);
    reject(key, expected, describe(*value));
  }

  int required_int(std::string_view key, int min) const {
    if (const std::optional<int> value = integer(key, min)) return *value;
    reject(key, "expected an integer", "no such key");
  }

  template <typename Int>
  Int optional_int(std::string_view key, Int fallback, Int min) const {
    return integer(key, min).value_or(fallback);
  }

  // A finite number; f32/f64 through decimal(), times 10^shift.
  double optional_real(std::string_view key, double fallback, int shift = 0) const {
    const Value* value = find(key);
    if (!value) return fallback;
    if (const auto* u = std::get_if<uint64_t>(&value->data)) return static_cast<double>(*u) * std::pow(10.0, shift);
    if (const auto* i = std::get_if<int64_t>(&value->data)) return static_cast<double>(*i) * std::pow(10.0, shift);
    if (!std::holds_alternative<double>(value->data) || !std::isfinite(std::get<double>(value->data)))
      reject(key, "expected a finite number", describe(*value));
    return decimal(*value, shift);
  }

  std::optional<std::string> optional_string(std::string_view key) const {
    const Value* value = find(key);
    if (!value) return std::nullopt;
    if (const auto* text = std::get_if<std::string>(&value->data)) return *text;
    reject(key, "expected a string", describe(*value));
  }

 private:
  const File& file_;
};

RopeSpec read_rope(const Metadata& meta, const std::string& arch) {
  RopeSpec rope;
  rope.theta = meta.optional_real(arch + ".rope.freq_base", rope.theta);
  const std::string type_key = arch + ".rope.scaling.type";
  const std::optional<std::string> type = meta.optional_string(type_key);
  if (!type || *type == "none") return rope;
  // Anything else (linear, longrope, ...) would change the positions in a way RopeSpec cannot express.
  if (*type != "yarn") meta.reject(type_key, R"(expected "yarn" or "none")", "string " + printable(*type));
  const std::string scaling = arch + ".rope.scaling.";
  rope.yarn = true;
  rope.factor = meta.optional_real(scaling + "factor", rope.factor);
  rope.original_max_position_embeddings =
      meta.optional_int<int64_t>(scaling + "original_context_length", rope.original_max_position_embeddings, 0);
  rope.beta_fast = meta.optional_real(scaling + "yarn_beta_fast", rope.beta_fast);
  rope.beta_slow = meta.optional_real(scaling + "yarn_beta_slow", rope.beta_slow);
  // The converter stores 0.1 * mscale_all_dim here for this family; mscale has no key and all the family's
  // configs set 1.0, RopeSpec's default.
  rope.mscale_all_dim = meta.optional_real(scaling + "yarn_log_multiplier", rope.mscale_all_dim, 1);
  return rope;
}

}  // namespace

AttentionSpec spec_from_gguf(const File& file) {
  const Metadata meta(file);
  const std::optional<std::string> arch_name = meta.optional_string("general.architecture");
  const auto arch = std::ranges::find(kArchitectures, arch_name.value_or(""), &Architecture::name);
  if (arch == std::end(kArchitectures))
    meta.reject("general.architecture", "expected one of deepseek2, deepseek32, glm-dsa",
                arch_name ? "string " + printable(*arch_name) : "no such key");
  const std::string a = std::string(arch->name);

  AttentionSpec spec;
  spec.name = file.path;
  spec.model_type = std::string(arch->model_type);
  if (arch->name == "deepseek2") {
    // One architecture holds DeepSeek-V3/R1, Kimi-K2 and GLM-4.7-Flash; the tokenizer tells them apart.
    const std::string pre = meta.optional_string("tokenizer.ggml.pre").value_or("");
    if (pre == "kimi-k2") spec.model_type = "kimi_k2";
    if (pre == "glm4") spec.model_type = "glm4_moe_lite";
  }
  spec.hidden_size = meta.required_int(a + ".embedding_length", 1);
  spec.num_heads = meta.required_int(a + ".attention.head_count", 1);
  spec.q_lora_rank = meta.optional_int(a + ".attention.q_lora_rank", 0, 0);
  spec.kv_lora_rank = meta.required_int(a + ".attention.kv_lora_rank", 1);
  const std::string key_length = a + ".attention.key_length", value_length = a + ".attention.value_length";
  const int key = meta.required_int(key_length, 1);
  const int value = meta.required_int(value_length, 1);
  if (meta.find(a + ".attention.key_length_mla")) {
    // MLA stored as MQA: one latent head [c | k_pe] of kv_lora + rope, value c; the per-head sizes in *_mla.
    if (value != spec.kv_lora_rank)
      meta.reject(value_length, "expected kv_lora_rank (" + num(spec.kv_lora_rank) + ")", num(value));
    if (key <= spec.kv_lora_rank)
      meta.reject(key_length, "expected kv_lora_rank + qk_rope_head_dim (more than " + num(spec.kv_lora_rank) + ")",
                  num(key));
    spec.qk_rope_head_dim = key - spec.kv_lora_rank;
    const std::string key_mla = a + ".attention.key_length_mla";
    const int qk_head_dim = meta.required_int(key_mla, 1);
    if (qk_head_dim <= spec.qk_rope_head_dim)
      meta.reject(key_mla, "expected qk_nope_head_dim + qk_rope_head_dim (more than " +
                               num(spec.qk_rope_head_dim) + ")", num(qk_head_dim));
    spec.qk_nope_head_dim = qk_head_dim - spec.qk_rope_head_dim;
    spec.v_head_dim = meta.required_int(a + ".attention.value_length_mla", 1);
  } else {
    // Files converted before llama.cpp stored MLA as MQA: per-head sizes, the RoPE part in rope.dimension_count.
    spec.qk_rope_head_dim = meta.required_int(a + ".rope.dimension_count", 1);
    if (key <= spec.qk_rope_head_dim)
      meta.reject(key_length, "expected qk_nope_head_dim + qk_rope_head_dim (more than " +
                                  num(spec.qk_rope_head_dim) + ")", num(key));
    spec.qk_nope_head_dim = key - spec.qk_rope_head_dim;
    spec.v_head_dim = value;
  }
  // block_count includes the NextN (multi-token prediction) layers that deepseek32 and glm-dsa files carry.
  const int blocks = meta.required_int(a + ".block_count", 0);
  const std::string nextn_key = a + ".nextn_predict_layers";
  const int nextn = meta.optional_int(nextn_key, 0, 0);
  if (nextn > blocks) meta.reject(nextn_key, "expected at most block_count (" + num(blocks) + ")", num(nextn));
  spec.num_layers = blocks - nextn;
  spec.num_attention_layers = spec.num_layers;  // the architectures read here have no linear-attention layers
  const std::string eps_key = a + ".attention.layer_norm_rms_epsilon";
  spec.rms_norm_eps = meta.optional_real(eps_key, spec.rms_norm_eps);
  if (!(spec.rms_norm_eps > 0)) meta.reject(eps_key, "expected a positive number", describe(*meta.find(eps_key)));
  spec.rope = read_rope(meta, a);
  spec.rope_style = RopeStyle::interleaved;  // MLA's RoPE is interleaved in every architecture here
  if (arch->sparse) {
    const std::string indexer = a + ".attention.indexer.";
    spec.indexer = IndexerSpec{.heads = meta.required_int(indexer + "head_count", 1),
                               .head_dim = meta.required_int(indexer + "key_length", 1),
                               .topk = meta.required_int(indexer + "top_k", 1),
                               .rope_style = arch->indexer_rope};
  }
  spec.softmax_scale = reference_softmax_scale(spec.qk_head_dim(), spec.rope);
  validate(spec, file.path);
  return spec;
}

AttentionSpec spec_from_gguf_file(const std::string& path) { return spec_from_gguf(Model::open(path).metadata()); }

}  // namespace smla::gguf
