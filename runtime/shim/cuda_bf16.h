// Host stand-in for <cuda_bf16.h>: bfloat16 as the top 16 bits of a float,
// converted with round-to-nearest-even as the device intrinsics do.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float shim_bf16_to_float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 shim_float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) { return shim_bf16_to_float(h); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return shim_float_to_bf16(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{shim_bf16_to_float(h.x), shim_bf16_to_float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{shim_float_to_bf16(a), shim_float_to_bf16(b)};
}
