#include <gtest/gtest.h>

#include <cmath>

#include "core/numeric.h"
#include "core/random.h"
#include "smla/error.h"
#include "smla/types.h"
#include "support/test_util.h"

namespace smla {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::fp8_ds_mla), 1u);
  EXPECT_EQ(kFp8DsMlaRowBytes, 656);
  EXPECT_EQ(kFp8IndexRowBytes, 132);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("FLOAT16"), DType::f16);
  EXPECT_EQ(parse_dtype("fp8_ds_mla"), DType::fp8_ds_mla);
  EXPECT_FALSE(parse_dtype("int4").has_value());
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_ds_mla, DType::i32, DType::i64})
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
}

TEST(Device, Parse) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("sm_120").compute_capability, 120);
  EXPECT_EQ(parse_device("sm_90a").compute_capability, 90);
  EXPECT_EQ(parse_device("cuda:1").index, 1);
  EXPECT_EQ(parse_device("sm_86").name(), "sm_86");
  for (const char* bad : {"gpu", "sm_", "sm_x", "cuda:-1", "sm_5"}) {
    try {
      parse_device(bad, "--device");
      FAIL() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--device"), std::string::npos) << e.what();
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    }
  }
}

TEST(TensorView, ContiguousStridesAndDescribe) {
  float x[24];
  TensorView v(x, {2, 3, 4}, DType::f32);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(-1), 1);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "[2, 3, 4] float32 on cpu");
  TensorView s(x, {2, 3}, {12, 1}, DType::f32);
  EXPECT_FALSE(s.is_contiguous());
}

// The constructors' checks (a message built from parts, and require's literal one): clear errors.
TEST(TensorView, ConstructorsRefuseTooManyDimsAndMismatchedStrides) {
  test::expect_error([] { TensorView(nullptr, {1, 2, 3, 4, 5, 6, 7}, DType::f32); }, ErrorKind::invalid_argument,
                     {"TensorView: at most 6 dimensions"});
  test::expect_error([] { TensorView(nullptr, {2, 3}, {3}, DType::f32); }, ErrorKind::invalid_argument,
                     {"TensorView: strides and shape differ in length"});
}

TEST(TensorView, DlpackRoundTrip) {
  uint16_t x[2 * 8 * 576];
  TensorView v(x + 8, {2, 8, 576}, {8 * 576 + 16, 576, 1}, DType::bf16);
  DLTensor t = v.to_dlpack();
  EXPECT_EQ(t.dtype.code, kDLBfloat);
  EXPECT_EQ(t.dtype.bits, 16);
  TensorView back = TensorView::from_dlpack(t, "q");
  EXPECT_EQ(back.data, v.data);
  EXPECT_EQ(back.shape, v.shape);
  EXPECT_EQ(back.strides, v.strides);
  EXPECT_EQ(back.dtype, DType::bf16);

  // Byte offset folds into data; null strides mean contiguous; fp8 travels as uint8.
  int64_t shape[2] = {3, 656};
  DLTensor raw{};
  raw.data = x;
  raw.byte_offset = 4;
  raw.device = {kDLCPU, 0};
  raw.ndim = 2;
  raw.dtype = {kDLUInt, 8, 1};
  raw.shape = shape;
  TensorView c = TensorView::from_dlpack(raw, "kv_cache", DType::fp8_ds_mla);
  EXPECT_EQ(c.data, reinterpret_cast<char*>(x) + 4);
  EXPECT_EQ(c.stride(0), 656);
  EXPECT_EQ(c.dtype, DType::fp8_ds_mla);
  const auto bad = [&](const std::string& fragment, std::optional<DType> as = std::nullopt) {
    test::expect_error([&] { TensorView::from_dlpack(raw, "kv_cache", as); }, ErrorKind::invalid_argument,
                       {"kv_cache: ", fragment});
  };
  bad("cannot view uint8 as bfloat16", DType::bf16);  // 1-byte data viewed as 2-byte
  raw.dtype = {kDLComplex, 64, 1};
  bad("has no smla equivalent");
  raw.dtype = {kDLUInt, 8, 4};
  bad("lanes != 1");
  raw.dtype = {kDLUInt, 8, 1};
  raw.device = {kDLOpenCL, 0};
  bad("is not cpu or cuda");
  raw.device = {kDLCPU, 0};
  raw.ndim = 9;
  bad("at most");
}

// The generator behind random weights, the CLI's data and the benchmarks:
// Marsaglia's xorshift64 (13, 7, 17), values computed independently; seeds
// map to state seed * 0x9e3779b97f4a7c15 + 1.
TEST(Xorshift64, SequenceAndRange) {
  Xorshift64 raw(1);
  EXPECT_EQ(raw.next(), 0x40822041ull);
  Xorshift64 seeded = Xorshift64::seeded(1);
  EXPECT_EQ(seeded.next(), 0xdc1b77aeca752d6eull);
  EXPECT_EQ(seeded.next(), 0x54f02db3166f5cb4ull);
  EXPECT_EQ(seeded.next(), 0xd624c3e45e182f0dull);
  // symmetric(): the top 24 bits as a point of [-1, 1) on a 2^-23 grid.
  Xorshift64 a = Xorshift64::seeded(7), b = Xorshift64::seeded(7);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    const float x = a.symmetric();
    ASSERT_EQ(x, static_cast<float>(static_cast<int64_t>(b.next() >> 40) - (int64_t{1} << 23)) * 0x1p-23f);
    ASSERT_TRUE(x >= -1.f && x < 1.f) << x;
    sum += x;
  }
  EXPECT_NEAR(sum / 100000, 0.0, 0.01);
}

TEST(Numeric, Bf16AndF16RoundTrips) {
  for (float f : {1.f, -2.5f, 3.14159f, 1e-3f, 65504.f, 6.1e-5f, 1e-7f}) {
    EXPECT_NEAR(numeric::bf16_to_float(numeric::float_to_bf16(f)), f, std::fabs(f) / 128);
    EXPECT_NEAR(numeric::f16_to_float(numeric::float_to_f16(f)), f, std::fabs(f) / 1024 + 6e-8);
  }
  EXPECT_TRUE(std::isinf(numeric::f16_to_float(numeric::float_to_f16(70000.f))));
  EXPECT_TRUE(std::isnan(numeric::bf16_to_float(numeric::float_to_bf16(NAN))));
  // Every f16 bit pattern (but NaNs) survives float and back.
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = numeric::f16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) EXPECT_EQ(numeric::float_to_f16(f), b);
  }
}

TEST(Numeric, E4m3) {
  EXPECT_EQ(numeric::e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(numeric::e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_TRUE(std::isnan(numeric::e4m3_to_float(0x7f)));
  EXPECT_EQ(numeric::float_to_e4m3(1000.f), 0x7e);  // saturates
  // Every finite code survives float and back, and rounding picks the nearest code.
  for (int b = 0; b < 256; ++b) {
    const float f = numeric::e4m3_to_float(static_cast<uint8_t>(b));
    if (std::isnan(f)) continue;
    if (b == 0x80) continue;  // -0 encodes as 0x80, compare by value below
    EXPECT_EQ(numeric::float_to_e4m3(f), b) << b;
  }
  EXPECT_EQ(numeric::e4m3_to_float(numeric::float_to_e4m3(1.0625f)), 1.f);   // tie -> even mantissa
  EXPECT_EQ(numeric::e4m3_to_float(numeric::float_to_e4m3(1.1875f)), 1.25f);  // tie -> even mantissa
  EXPECT_EQ(numeric::ds_mla_tile_scale(448.f), 1.f);
  EXPECT_EQ(numeric::ds_mla_tile_scale(449.f), 2.f);
  EXPECT_EQ(numeric::ds_mla_tile_scale(0.f), numeric::pow2_ceil(1e-4f));
  // Just above a power of two rounds up, exactly a power stays.
  EXPECT_EQ(numeric::pow2_ceil(0x1p-10f * (1 + 0x1p-23f)), 0x1p-9f);
  EXPECT_EQ(numeric::pow2_ceil(0x1p-10f), 0x1p-10f);
  EXPECT_EQ(numeric::pow2_ceil(3.f), 4.f);
}

}  // namespace
}  // namespace smla
