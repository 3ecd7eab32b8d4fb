// The APK's host-side scaffolding beside the PTX layer (ptx_host.h): trace
// events for the drivers' checks, the race-window widener, and the protocol
// tier's role threads. In the protocol tier (APK_PROTOCOL_TIER) every CTA
// role (the producer warp, each math unit, the fp8 transform warps) is one
// OS thread standing for its whole warp or warpgroup, tiles only signal,
// and ThreadSanitizer sees the scheduler's acquire/release orderings as the
// PTX scopes state them. Trace events go to per-thread logs stamped by a
// relaxed global counter (the logical clock), which adds no synchronization
// ThreadSanitizer could mistake for the kernel's own.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace apk_host {

enum class Ev : uint32_t { post, instantiate, assign, read_assign, claim, start, end, op_done };

struct Event {
  uint64_t time;
  Ev kind;
  uint32_t a, b, c;
};

inline std::atomic<uint64_t> clock{0};
// Microseconds CTA 0 stalls between publishing an operation's fields and its
// claim word: a wrong publication order then shows as a hang or a stale read.
inline unsigned widen_us = 0;
// Where this OS thread's events go (null: nowhere). Fibers of one launch share their OS thread's log.
inline thread_local std::vector<Event>* log = nullptr;

inline void trace(Ev kind, uint32_t a, uint32_t b, uint32_t c) {
  const uint64_t t = clock.fetch_add(1, std::memory_order_relaxed);
  if (log) log->push_back(Event{t, kind, a, b, c});
}

}  // namespace apk_host

#define APK_WIDEN_RACE_WINDOW()                                                     \
  do {                                                                              \
    if (::apk_host::widen_us)                                                       \
      std::this_thread::sleep_for(std::chrono::microseconds(::apk_host::widen_us)); \
  } while (0)

#define APK_TRACE(kind, a, b, c) \
  ::apk_host::trace(::apk_host::Ev::kind, static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c))
