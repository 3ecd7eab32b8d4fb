// Host emulation of the APK's execution model: every CTA is one std::thread
// for its producer warp plus one per math unit, a CTA cluster shares a table
// of its CTAs' shared memory (distributed shared memory), mbarriers are
// phase counters with release arrivals and acquire waits, and the PTX scoped
// loads, stores and atomics map to std::atomic_ref with the same orderings
// (the system and device scopes are both the process here). Trace events go to per-thread logs stamped by a relaxed global
// counter (the logical clock), which adds no synchronization ThreadSanitizer
// could mistake for the kernel's own.
#pragma once

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
#include "cuda_bf16.h"

#define __device__
#define __global__
#define __forceinline__ inline

inline float __expf(float x) { return std::exp(x); }
// fp8 e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN) to float, exactly.
inline float shim_fp8e4m3_decode(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man) / 8.0f, -6);
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}
inline float shim_fp8e4m3_to_float(uint8_t b) {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = shim_fp8e4m3_decode(static_cast<uint8_t>(i));
    return t;
  }();
  return table[b];
}
inline __nv_bfloat16 __float2bfloat16(float f) { return shim_float_to_bf16(f); }

namespace apk_host {

enum class Ev : uint32_t { post, instantiate, assign, read_assign, claim, start, end, op_done };

struct Event {
  uint64_t time;
  Ev kind;
  uint32_t cta, a, b, c;
};

inline std::atomic<uint64_t> clock{0};
// Whether tiles compute (small shapes) or only schedule (full-size shapes).
inline bool compute = true;
// Microseconds CTA 0 stalls between publishing an operation's fields and its
// claim word: a wrong publication order then shows as a hang or a stale read.
inline unsigned widen_us = 0;
inline thread_local std::vector<Event>* log = nullptr;
inline thread_local uint32_t cta = 0;
inline thread_local uint32_t rank = 0;

// A cluster: its CTAs' shared memory (distributed shared memory: a peer's
// field is the same offset in the peer's block).
struct Cluster {
  std::vector<void*> smem;
};
inline thread_local Cluster* cluster = nullptr;
inline thread_local void* smem = nullptr;  // this CTA's shared memory

template <typename T>
inline T* peer(T* local, uint32_t rank) {
  const std::ptrdiff_t off = reinterpret_cast<char*>(local) - static_cast<char*>(smem);
  return reinterpret_cast<T*>(static_cast<char*>(cluster->smem[rank]) + off);
}

// An mbarrier: a phase counter and the arrivals still missing in this phase.
// Arrivals release, waits acquire (the PTX barrier's default orderings).
struct Mbar {
  std::atomic<uint64_t> word{0};  // phase (high 32 bits) | arrivals so far (low 32)
  uint32_t count = 0;
  void arrive() {
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t phase = w >> 32, got = (w & 0xffffffffu) + 1;
      const uint64_t next = got == count ? (phase + 1) << 32 : (phase << 32) | got;
      if (word.compare_exchange_weak(w, next, std::memory_order_acq_rel, std::memory_order_relaxed)) return;
    }
  }
  // Phase `parity` completed: the current phase's parity differs.
  bool done(uint32_t parity) const { return ((word.load(std::memory_order_acquire) >> 32) & 1u) != parity; }
};

// The kernel's TMA descriptors are not used on the host.
struct TensorMap {
  unsigned char opaque[128];
};

inline void trace(Ev kind, uint32_t a, uint32_t b, uint32_t c) {
  const uint64_t t = clock.fetch_add(1, std::memory_order_relaxed);
  if (log) log->push_back(Event{t, kind, cta, a, b, c});
}

template <typename T>
inline std::atomic_ref<T> at(const T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p));
}

}  // namespace apk_host

#define APK_WIDEN_RACE_WINDOW() \
  do {                            \
    if (::apk_host::widen_us)     \
      std::this_thread::sleep_for(std::chrono::microseconds(::apk_host::widen_us)); \
  } while (0)

#define APK_TRACE(kind, a, b, c) \
  ::apk_host::trace(::apk_host::Ev::kind, static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c))

namespace apk {
inline uint32_t ld_acquire_sys(const uint32_t* p) { return apk_host::at(p).load(std::memory_order_acquire); }
inline uint32_t ld_acquire_gpu(const uint32_t* p) { return apk_host::at(p).load(std::memory_order_acquire); }
inline unsigned long long ld_relaxed_gpu64(const unsigned long long* p) {
  return apk_host::at(p).load(std::memory_order_relaxed);
}
inline void st_release_sys(uint32_t* p, uint32_t v) { apk_host::at(p).store(v, std::memory_order_release); }
inline void st_release_gpu(uint32_t* p, uint32_t v) { apk_host::at(p).store(v, std::memory_order_release); }
inline void st_release_gpu64(unsigned long long* p, unsigned long long v) {
  apk_host::at(p).store(v, std::memory_order_release);
}
inline uint32_t add_acq_rel_gpu(uint32_t* p, uint32_t v) { return apk_host::at(p).fetch_add(v, std::memory_order_acq_rel); }
inline unsigned long long add_acq_rel_gpu64(unsigned long long* p, unsigned long long v) {
  return apk_host::at(p).fetch_add(v, std::memory_order_acq_rel);
}
inline void backoff() { std::this_thread::yield(); }
[[noreturn]] inline void fail() {
  std::fprintf(stderr, "apk: operation exceeds the compiled buffers\n");
  std::abort();
}
inline unsigned long long now_ns() { return apk_host::clock.load(std::memory_order_relaxed); }
inline uint32_t cluster_rank() { return apk_host::rank; }
inline void mbar_init(apk_host::Mbar* b, uint32_t count) { b->count = count; }
inline void mbar_arrive(apk_host::Mbar* b) { b->arrive(); }
inline void mbar_arrive_at(apk_host::Mbar* b, uint32_t rank) { apk_host::peer(b, rank)->arrive(); }
inline void mbar_arrive_if(bool pred, apk_host::Mbar* b) {
  if (pred) b->arrive();
}
inline void mbar_arrive_at_if(bool pred, apk_host::Mbar* b, uint32_t rank) {
  if (pred) mbar_arrive_at(b, rank);
}
// Like the device's try_wait, which suspends the thread for a while before
// reporting an incomplete phase: a failed poll yields.
inline bool mbar_try_wait(apk_host::Mbar* b, uint32_t parity) {
  if (b->done(parity)) return true;
  std::this_thread::yield();
  return false;
}
inline void mbar_wait(apk_host::Mbar* b, uint32_t parity) {
  while (!b->done(parity)) std::this_thread::yield();
}
template <typename D>
inline void store_decision_at(D* slot, uint32_t rank, const D& d) {
  *apk_host::peer(slot, rank) = d;
}
// One host thread per producer warp and per math unit: broadcasts and unit
// barriers are trivial, and the arrivals' release orders the tile's outputs.
template <typename D>
inline D warp_broadcast(const D& d) {
  return d;
}
inline void unit_sync(uint32_t) {}
inline void fence_tile_outputs_if(bool) {}
}  // namespace apk
