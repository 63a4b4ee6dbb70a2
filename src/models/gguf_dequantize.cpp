// GGUF tensors as float32. Block layouts from gguf-py's quants.py; each formula keeps gguf-py's order of float32
// operations, so the results match it bit for bit.
#include "models/gguf.h"

#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "models/gguf_text.h"
#include "smla/error.h"

namespace smla::gguf {

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

}  // namespace smla::gguf
