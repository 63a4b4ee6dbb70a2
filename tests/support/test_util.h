// Helpers shared by the tests: deterministic random tensors (never zeros),
// NaN poisoning, sentinel outputs and FlashMLA-style tolerance checks.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "smla/error.h"
#include "smla/types.h"

namespace smla::test {

// Deterministic generator; every test seeds its own.
using Rng = std::mt19937_64;

// n values uniform in [lo, hi), rejecting exact zeros.
std::vector<float> random_floats(Rng& rng, size_t n, float lo = -1.f, float hi = 1.f);

// Storage-typed buffer (bf16 / f16 as uint16, f32 as float bits) holding
// `values` rounded to `dtype`; `rounded` receives the values actually stored.
std::vector<uint16_t> to_half_bits(const std::vector<float>& values, DType dtype, std::vector<float>* rounded = nullptr);
float half_bits_to_float(uint16_t bits, DType dtype);
// `values` stored as `dtype` (f32, or bf16 / f16 bits as to_half_bits rounds them) in a byte buffer.
std::vector<uint8_t> to_bytes(const std::vector<float>& values, DType dtype);

// FlashMLA-style comparison: every element |a - b| <= abs_tol + rel_tol * |b|
// (NaN anywhere fails), and cosine similarity >= min_cos. Returns "" when it
// passes, else a description of the first failures.
std::string compare(const std::vector<double>& expected, const std::vector<double>& actual, double abs_tol,
                    double rel_tol, double min_cos = 0.999);

// Runs `action` and expects one smla::Error of `kind` whose one-line message
// holds every fragment (gtest failures otherwise).
void expect_error(const std::function<void()>& action, ErrorKind kind, const std::vector<std::string>& fragments);

}  // namespace smla::test
