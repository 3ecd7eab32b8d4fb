// A host shim that runs CUDA kernels on the CPU: every CUDA thread is a fiber
// (a ucontext with its own stack) on the launching OS thread, blocks run one
// after another, __syncthreads is a block-wide barrier between the fibers,
// and warp primitives (shuffles, ballot) exchange values through
// per-warp slots between two warp-wide barriers. Threads that return early drop
// out of their barriers, as exited threads do on a GPU. Only the subset of CUDA
// the emitted kernels use is provided; anything else fails to compile, which is
// the point.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sys/mman.h>
#include <ucontext.h>
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

// A barrier among the fibers of one block (or one warp). Fibers run one at a
// time, so plain counters suffice; a waiting fiber is resumed once the phase
// it waited in has completed.
struct Barrier {
  unsigned expected;
  unsigned arrived = 0;
  uint64_t phase = 0;
  explicit Barrier(unsigned n) : expected(n) {}
  void arrive_and_wait();
  // An exited thread leaves the barrier; if everyone left is waiting, the
  // phase completes.
  void arrive_and_drop() {
    --expected;
    if (arrived > 0 && arrived >= expected) complete();
  }
  void complete() {
    arrived = 0;
    ++phase;
  }
};

struct Block {
  std::unique_ptr<Barrier> block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint64_t> slots;  // 32 per warp
};

// One CUDA thread: a context with its own stack (guarded below), reused
// from launch to launch.
struct Fiber {
  ucontext_t ctx;
  void* map = nullptr;
  const Barrier* wait = nullptr;
  uint64_t wait_phase = 0;
  bool done = false;
};

constexpr size_t kStack = 256 << 10;
constexpr size_t kGuard = 4096;

inline ShimDim3 tid;
inline ShimDim3 bid;
inline ShimDim3 bdim;
inline ShimDim3 gdim;
inline Block* current = nullptr;
inline ucontext_t scheduler;
inline Fiber* running = nullptr;
inline std::vector<std::unique_ptr<Fiber>> fibers;
inline void (*body)(void*) = nullptr;
inline void* body_arg = nullptr;

inline unsigned lane() { return tid.x & 31u; }
inline unsigned warp() { return tid.x >> 5; }
inline Barrier& warp_barrier() { return *current->warps[warp()]; }

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

inline void Barrier::arrive_and_wait() {
  const uint64_t p = phase;
  if (++arrived >= expected) return complete();
  running->wait = this;
  running->wait_phase = p;
  swapcontext(&running->ctx, &scheduler);
}

inline void trampoline() {
  body(body_arg);
  current->warps[tid.x >> 5]->arrive_and_drop();
  current->block->arrive_and_drop();
  running->done = true;
}  // returns to `scheduler` through uc_link

inline Fiber& fiber(unsigned t) {
  while (fibers.size() <= t) {
    auto f = std::make_unique<Fiber>();
    f->map = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f->map == MAP_FAILED) {
      std::fprintf(stderr, "shim: cannot map a thread stack\n");
      std::abort();
    }
    mprotect(f->map, kGuard, PROT_NONE);  // a stack overflow faults
    fibers.push_back(std::move(f));
  }
  return *fibers[t];
}

// Runs one block: its threads as fibers on this OS thread, each run until it
// waits on a barrier or exits, round-robin, a waiting one resumed once its
// barrier's phase has completed. A round in which nothing can run is a
// deadlock (on a GPU, a hang): abort.
inline void run_block(unsigned b, unsigned block) {
  Block blk;
  blk.block = std::make_unique<Barrier>(block);
  const unsigned nwarps = (block + 31) / 32;
  for (unsigned w = 0; w < nwarps; ++w) blk.warps.push_back(std::make_unique<Barrier>(std::min(32u, block - 32 * w)));
  blk.slots.assign(nwarps * 32, 0);
  current = &blk;
  bid = ShimDim3{b, 0, 0};
  for (unsigned t = 0; t < block; ++t) {
    Fiber& f = fiber(t);
    f.done = false;
    f.wait = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = static_cast<char*>(f.map) + kGuard;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, trampoline, 0);
  }
  for (unsigned left = block; left > 0;) {
    bool ran = false;
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = *fibers[t];
      if (f.done || (f.wait && f.wait->phase == f.wait_phase)) continue;
      f.wait = nullptr;
      running = &f;
      tid = ShimDim3{t, 0, 0};
      swapcontext(&scheduler, &f.ctx);
      ran = true;
      if (f.done) --left;
    }
    if (!ran) {
      std::fprintf(stderr, "shim: block %u deadlocked: %u thread(s) wait on a barrier the others never reach\n", b, left);
      std::abort();
    }
  }
  running = nullptr;
  current = nullptr;
}

// Runs `kernel(args...)` over `grid` blocks of `block` threads, blocks one
// after another.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), unsigned grid, unsigned block, Args... args) {
  gdim = ShimDim3{grid, 1, 1};
  bdim = ShimDim3{block, 1, 1};
  auto call = [&] { kernel(args...); };
  body = [](void* c) { (*static_cast<decltype(call)*>(c))(); };
  body_arg = &call;
  for (unsigned b = 0; b < grid; ++b) run_block(b, block);
  body = nullptr;
  body_arg = nullptr;
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
