// Element-wise kernels on raw typed buffers for the communicators (comm layer; std only).
// 16-bit floats are converted through float for arithmetic (round to nearest even on the way back).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fsdp/comm/communicator.hpp"

namespace fsdp::detail {

/// MpiComm's ring reduce-scatter moves a chunk in segments of at most these bytes, so its two scratch
/// buffers stay small whatever the unit (a 32000 x 768 LM head's shard at 4 ranks needed 47 MiB).
inline constexpr std::int64_t kRingSegmentBytes = std::int64_t{4} << 20;

inline float bf16_to_float(std::uint16_t bits) noexcept { return std::bit_cast<float>(std::uint32_t{bits} << 16); }
inline std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // keep NaN a NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }  // subnormal: normalize
    ++exp;
    mant &= 0x3ffu;
  } else if (exp == 31) {
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline std::uint16_t float_to_f16(float value) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                                              // overflow to inf
  if (abs < 0x38800000u) {                                                                    // subnormal or zero in half
    const float f = std::bit_cast<float>(abs) * 16777216.0f;                                  // scale by 2^24
    return sign | static_cast<std::uint16_t>(static_cast<std::uint32_t>(std::nearbyint(f)));  // ties to even
  }
  std::uint32_t bits = abs - 0x38000000u;  // rebias 127 -> 15
  bits += 0xfffu + ((bits >> 13) & 1u);
  return sign | static_cast<std::uint16_t>(bits >> 13);
}

template <class T>
void add_typed(const void* a, const void* b, void* out, std::int64_t n) {
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* z = static_cast<T*>(out);
  for (std::int64_t i = 0; i < n; ++i) z[i] = static_cast<T>(x[i] + y[i]);
}

template <float (*ToFloat)(std::uint16_t) noexcept, std::uint16_t (*FromFloat)(float) noexcept>
void add_half(const void* a, const void* b, void* out, std::int64_t n) {
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  auto* z = static_cast<std::uint16_t*>(out);
  for (std::int64_t i = 0; i < n; ++i) z[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

/// out = a + b element-wise (out may alias a or b).
inline void add_buffers(const void* a, const void* b, void* out, std::int64_t n, DType t) {
  switch (t) {
    case DType::kFloat32: return add_typed<float>(a, b, out, n);
    case DType::kFloat64: return add_typed<double>(a, b, out, n);
    case DType::kInt32: return add_typed<std::int32_t>(a, b, out, n);
    case DType::kInt64: return add_typed<std::int64_t>(a, b, out, n);
    case DType::kUInt8: return add_typed<std::uint8_t>(a, b, out, n);
    case DType::kBFloat16: return add_half<bf16_to_float, float_to_bf16>(a, b, out, n);
    case DType::kFloat16: return add_half<f16_to_float, float_to_f16>(a, b, out, n);
  }
}

/// buf *= factor element-wise (integers are truncated).
inline void scale_buffer(void* buf, std::int64_t n, DType t, double factor) {
  auto scale = [&](auto* p) {
    for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<std::remove_reference_t<decltype(*p)>>(p[i] * factor);
  };
  switch (t) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      const float f = static_cast<float>(factor);
      for (std::int64_t i = 0; i < n; ++i) p[i] *= f;
      return;
    }
    case DType::kFloat64: return scale(static_cast<double*>(buf));
    case DType::kInt32: return scale(static_cast<std::int32_t*>(buf));
    case DType::kInt64: return scale(static_cast<std::int64_t*>(buf));
    case DType::kUInt8: return scale(static_cast<std::uint8_t*>(buf));
    case DType::kBFloat16: {
      auto* p = static_cast<std::uint16_t*>(buf);
      for (std::int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) * static_cast<float>(factor));
      return;
    }
    case DType::kFloat16: {
      auto* p = static_cast<std::uint16_t*>(buf);
      for (std::int64_t i = 0; i < n; ++i) p[i] = float_to_f16(f16_to_float(p[i]) * static_cast<float>(factor));
      return;
    }
  }
}

}  // namespace fsdp::detail
