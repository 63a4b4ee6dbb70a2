#include "support/test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "core/numeric.h"

namespace smla::test {

std::vector<float> random_floats(Rng& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = dist(rng);
    while (x == 0.f);
  }
  return v;
}

float half_bits_to_float(uint16_t bits, DType dtype) {
  return dtype == DType::bf16 ? numeric::bf16_to_float(bits) : numeric::f16_to_float(bits);
}

std::vector<uint16_t> to_half_bits(const std::vector<float>& values, DType dtype, std::vector<float>* rounded) {
  std::vector<uint16_t> bits(values.size());
  if (rounded) rounded->resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = dtype == DType::bf16 ? numeric::float_to_bf16(values[i]) : numeric::float_to_f16(values[i]);
    if (rounded) (*rounded)[i] = half_bits_to_float(bits[i], dtype);
  }
  return bits;
}

std::vector<uint8_t> to_bytes(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  if (dtype == DType::f32) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
  } else {
    const auto bits = to_half_bits(values, dtype);
    std::memcpy(bytes.data(), bits.data(), bytes.size());
  }
  return bytes;
}

std::string compare(const std::vector<double>& expected, const std::vector<double>& actual, double abs_tol,
                    double rel_tol, double min_cos) {
  std::ostringstream err;
  if (expected.size() != actual.size()) {
    err << "size mismatch: expected " << expected.size() << ", got " << actual.size();
    return err.str();
  }
  size_t bad = 0;
  double dot = 0, ne = 0, na = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double e = expected[i], a = actual[i];
    const bool same_inf = std::isinf(e) && e == a;
    if (!same_inf && !(std::fabs(a - e) <= abs_tol + rel_tol * std::fabs(e))) {
      if (bad++ < 5) err << "  [" << i << "] expected " << e << ", got " << a << "\n";
    }
    if (std::isfinite(e) && std::isfinite(a)) {
      dot += e * a;
      ne += e * e;
      na += a * a;
    }
  }
  if (bad) err << bad << " of " << expected.size() << " elements out of tolerance\n";
  if (ne > 0 && na > 0) {
    const double cos = dot / std::sqrt(ne * na);
    if (cos < min_cos) err << "cosine similarity " << cos << " < " << min_cos << "\n";
  }
  return err.str();
}

void expect_error(const std::function<void()>& action, ErrorKind kind, const std::vector<std::string>& fragments) {
  try {
    action();
    ADD_FAILURE() << "no error thrown; expected one mentioning \"" << fragments.front() << "\"";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(static_cast<int>(error.kind()), static_cast<int>(kind)) << message;
    for (const std::string& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "\"" << fragment << "\" not in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "not an smla::Error: " << error.what();
  }
}

}  // namespace smla::test
