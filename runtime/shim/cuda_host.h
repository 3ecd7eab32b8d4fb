// A host shim that runs CUDA kernels on the CPU for tests: every CUDA thread is
// a std::thread, blocks run one after another, __syncthreads is a block-wide
// std::barrier, and warp primitives (shuffles, ballot) exchange values through
// per-warp slots between two warp-wide barriers. Threads that return early drop
// out of their barriers, as exited threads do on a GPU. Only the subset of CUDA
// the emitted kernels use is provided; anything else fails to compile, which is
// the point.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Blocks run one at a time, so a function-local static is the block's shared memory.
#define __shared__ static
#define __constant__

struct ShimDim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace shim {

struct Block {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> slots;  // 32 per warp
};

inline thread_local ShimDim3 tid;
inline thread_local ShimDim3 bid;
inline ShimDim3 bdim;
inline ShimDim3 gdim;
inline Block* current = nullptr;

inline unsigned lane() { return tid.x & 31u; }
inline unsigned warp() { return tid.x >> 5; }
inline std::barrier<>& warp_barrier() { return *current->warps[warp()]; }

template <typename T>
inline uint64_t bits(T v) {
  static_assert(sizeof(T) <= 8);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Publishes `v` for this lane, then reads lane `src`'s value.
template <typename T>
inline T exchange(T v, int src) {
  uint64_t* s = &current->slots[warp() * 32];
  s[lane()] = bits(v);
  warp_barrier().arrive_and_wait();
  const T out = from_bits<T>(s[src]);
  warp_barrier().arrive_and_wait();
  return out;
}

// Runs `kernel(args...)` over `grid` blocks of `block` threads.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), unsigned grid, unsigned block, Args... args) {
  gdim = ShimDim3{grid, 1, 1};
  bdim = ShimDim3{block, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    Block blk;
    blk.block = std::make_unique<std::barrier<>>(block);
    const unsigned nwarps = (block + 31) / 32;
    for (unsigned w = 0; w < nwarps; ++w) {
      const unsigned lanes = std::min(32u, block - 32 * w);
      blk.warps.push_back(std::make_unique<std::barrier<>>(lanes));
    }
    blk.slots.assign(nwarps * 32, 0);
    current = &blk;
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([=, &blk] {
        tid = ShimDim3{t, 0, 0};
        bid = ShimDim3{b, 0, 0};
        kernel(args...);
        blk.warps[t >> 5]->arrive_and_drop();
        blk.block->arrive_and_drop();
      });
    }
    for (auto& th : threads) th.join();
    current = nullptr;
  }
}

}  // namespace shim

#define threadIdx (::shim::tid)
#define blockIdx (::shim::bid)
#define blockDim (::shim::bdim)
#define gridDim (::shim::gdim)

inline void __syncthreads() { shim::current->block->arrive_and_wait(); }
[[noreturn]] inline void __trap() { std::abort(); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned v;
  std::memcpy(&v, &f, 4);
  return v;
}
// The SFU's sine and cosine, here at full precision (the device's are
// accurate to ~2^-21 on [-π, π], where the kernels call them).
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
// sqrtf, rint and fma (double) come from <cmath>, as the device's do.

template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  return shim::exchange(v, src & 31);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return shim::exchange(v, static_cast<int>(shim::lane()) ^ mask);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
  const int l = static_cast<int>(shim::lane());
  const int src = l >= static_cast<int>(delta) ? l - static_cast<int>(delta) : l;
  return shim::exchange(v, src);
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  uint64_t* s = &shim::current->slots[shim::warp() * 32];
  s[shim::lane()] = pred ? 1 : 0;
  shim::warp_barrier().arrive_and_wait();
  const unsigned lanes = std::min(32u, shim::bdim.x - 32 * shim::warp());
  unsigned out = 0;
  for (unsigned l = 0; l < lanes; ++l) out |= static_cast<unsigned>(s[l] != 0) << l;
  shim::warp_barrier().arrive_and_wait();
  return out;
}
