// A host shim that runs CUDA kernels on the CPU. Every CUDA thread is a
// fiber (a stack of its own, switched by a few instructions on x86-64, by
// ucontext elsewhere) on the launching OS thread; a scheduler resumes them
// round-robin. __syncthreads, named barriers (bar.sync), warp shuffles and
// the warp- and warpgroup-wide collectives of ptx_host.h meet between
// fibers; a fiber waiting for one is resumed only once the phase it waited
// in has completed. Threads that return early drop out of their barriers,
// as exited threads do on a GPU.
//
// Two launch forms:
//   - `launch`: blocks run one after another (a kernel's `__shared__` arrays
//     are then function-local statics: one block's shared memory at a time);
//   - `launch_resident`: every block of the grid is resident at once, in CTA
//     clusters with dynamic shared memory (`dynamic_smem`), as a persistent
//     kernel whose CTAs wait on each other needs; host fibers (an
//     "attention side" posting work to the grid) can run beside them.
// Asynchronous operations of ptx_host.h (bulk tensor copies, cp.async) land
// when control next returns to the scheduler, not when they are issued, so a
// thread that reads their destination before waiting on their barrier sees
// stale bytes, as it might on a GPU.
//
// A thread outside any launch (the APK protocol tier's OS threads, each
// standing for one role of a CTA) sees itself as its whole warp: shuffles
// return its own value and barriers do not wait.
//
// Only the subset of CUDA the emitted kernels use is provided; anything else
// fails to compile, which is the point.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <sys/mman.h>
#include <thread>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __restrict__ __restrict
// `launch` runs blocks one at a time, so a function-local static is the block's shared memory.
#define __shared__ static
#define __constant__

struct ShimDim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace shim {

[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "shim: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// ───────────────────────────── context switching ─────────────────────────────
#if defined(__x86_64__)
// Pushes the callee-saved registers, MXCSR and the x87 control word (the
// System V ABI's preserved state), stores the stack pointer in *from, loads
// `to` and pops the same state from there.
extern "C" void moeforge_shim_switch(void** from, void* to);
__asm__(
    ".text\n"
    ".weak moeforge_shim_switch\n"
    ".hidden moeforge_shim_switch\n"
    ".type moeforge_shim_switch,@function\n"
    "moeforge_shim_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size moeforge_shim_switch, .-moeforge_shim_switch\n");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

// A barrier among fibers (a block, a warp, a warpgroup, a named barrier or
// a cluster). Fibers run one at a time, so plain counters suffice.
struct Barrier {
  unsigned expected;
  unsigned arrived = 0;
  uint64_t phase = 0;
  explicit Barrier(unsigned n) : expected(n) {}
  // Returns true in the thread whose arrival completed the phase: it runs on
  // before any waiter resumes.
  bool arrive_and_wait();
  // An exited thread leaves the barrier; if everyone left is waiting, the
  // phase completes.
  void arrive_and_drop() {
    if (expected > 0) --expected;
    if (arrived > 0 && arrived >= expected) complete();
  }
  void complete() {
    arrived = 0;
    ++phase;
  }
};

struct Block;

// Where a CTA's shared memory is and which cluster it belongs to: the
// shared-memory window of ptx_host.h's addresses.
struct Cta {
  unsigned char* smem = nullptr;  // offset 0 of the CTA's shared window
  size_t bytes = 0;
  unsigned rank = 0;              // %cluster_ctarank
  unsigned size = 1;              // CTAs per cluster
  Cta* const* peers = nullptr;    // the cluster's CTAs by rank (null: no cluster)
};

struct Block {
  unsigned id = 0;
  unsigned threads = 0;
  std::unique_ptr<Barrier> block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<std::unique_ptr<Barrier>> groups;  // warpgroups (128 threads)
  std::unique_ptr<Barrier> named[16];            // bar.sync 1..15 (0 is `block`)
  std::vector<uint64_t> slots;                   // shuffles: 32 per warp
  std::vector<const void*> in;                   // collectives' operands: one per thread
  std::vector<uint64_t> out;                     // collectives' results: four per thread
  Barrier* cluster_barrier = nullptr;
  Cta cta;
  std::unique_ptr<unsigned char[], void (*)(void*)> smem{nullptr, std::free};
  std::shared_ptr<void> ptx;  // ptx_host.h's per-block state (the warpgroups' wgmma queues)
};

// One CUDA thread (or host fiber): a stack of its own, guarded below and
// reused from launch to launch.
struct Fiber {
  Context ctx;
  void* map = nullptr;
  Block* block = nullptr;
  unsigned tid = 0;
  // What it waits for: a barrier's phase, or a predicate.
  const Barrier* wait = nullptr;
  uint64_t wait_phase = 0;
  bool (*until)(const void*, uint64_t) = nullptr;
  const void* until_arg = nullptr;
  uint64_t until_val = 0;
  std::function<void()> host;  // a host fiber's body
  bool done = false;
};

constexpr size_t kStack = 256 << 10;
constexpr size_t kGuard = 4096;

inline ShimDim3 tid;
inline ShimDim3 bid;
inline ShimDim3 bdim;
inline ShimDim3 gdim;
inline Block* current = nullptr;
inline Context scheduler;
inline Fiber* running = nullptr;
inline std::vector<std::unique_ptr<Fiber>> fibers;
inline void (*body)(void*) = nullptr;
inline void* body_arg = nullptr;
// Asynchronous operations in flight: they land at the next return to the scheduler.
inline std::deque<std::function<void()>> async_ops;
// A thread outside any launch (the APK protocol tier's role threads) names its CTA here.
inline thread_local Cta* outside_cta = nullptr;

inline unsigned lane() { return tid.x & 31u; }
inline unsigned warp() { return tid.x >> 5; }
inline Barrier& warp_barrier() { return *current->warps[warp()]; }
// The calling thread's CTA: the running fiber's block, or the role thread's.
inline Cta* cta() { return running && running->block ? &running->block->cta : outside_cta; }

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

inline void switch_to_scheduler() {
#if defined(__x86_64__)
  moeforge_shim_switch(&running->ctx.sp, scheduler.sp);
#else
  swapcontext(&running->ctx.uc, &scheduler.uc);
#endif
}

inline void resume(Fiber& f) {
  running = &f;
  current = f.block;
  if (f.block) {
    tid = ShimDim3{f.tid, 0, 0};
    bid = ShimDim3{f.block->id, 0, 0};
  }
#if defined(__x86_64__)
  moeforge_shim_switch(&scheduler.sp, f.ctx.sp);
#else
  swapcontext(&scheduler.uc, &f.ctx.uc);
#endif
  running = nullptr;
  current = nullptr;
}

inline bool Barrier::arrive_and_wait() {
  const uint64_t p = phase;
  if (++arrived >= expected) {
    complete();
    return true;
  }
  running->wait = this;
  running->wait_phase = p;
  switch_to_scheduler();
  return false;
}

// Gives the scheduler a turn (a spinning thread).
inline void yield() {
  if (running) {
    switch_to_scheduler();
  } else {
    std::this_thread::yield();
  }
}

// Waits until `pred(arg, val)` holds; the scheduler tests it without resuming this thread.
inline void park_until(bool (*pred)(const void*, uint64_t), const void* arg, uint64_t val) {
  if (pred(arg, val)) return;
  if (!running) {
    while (!pred(arg, val)) std::this_thread::yield();
    return;
  }
  running->until = pred;
  running->until_arg = arg;
  running->until_val = val;
  switch_to_scheduler();
}

// An operation that completes asynchronously: it lands when control next
// returns to the scheduler (at once outside a launch).
inline void in_flight(std::function<void()> op) {
  if (running) {
    async_ops.push_back(std::move(op));
  } else {
    op();
  }
}
inline void land() {
  while (!async_ops.empty()) {
    auto op = std::move(async_ops.front());
    async_ops.pop_front();
    op();
  }
}

[[noreturn]] inline void fiber_exit() {
  Fiber* f = running;
  if (Block* b = f->block) {
    b->warps[f->tid >> 5]->arrive_and_drop();
    if (!b->groups.empty()) b->groups[f->tid >> 7]->arrive_and_drop();
    if (b->cluster_barrier) b->cluster_barrier->arrive_and_drop();
    b->block->arrive_and_drop();
  }
  f->done = true;
  switch_to_scheduler();
  die("a finished thread was resumed");
}

inline void fiber_main() {
  Fiber* f = running;
  if (f->host) {
    f->host();
  } else {
    body(body_arg);
  }
  fiber_exit();
}

inline Fiber& fiber(size_t t) {
  while (fibers.size() <= t) {
    auto f = std::make_unique<Fiber>();
    f->map = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f->map == MAP_FAILED) die("cannot map a thread stack");
    mprotect(f->map, kGuard, PROT_NONE);  // a stack overflow faults
    fibers.push_back(std::move(f));
  }
  return *fibers[t];
}

// Readies fiber `f` to start at fiber_main.
inline void prepare(Fiber& f, Block* block, unsigned t) {
  f.block = block;
  f.tid = t;
  f.done = false;
  f.wait = nullptr;
  f.until = nullptr;
  f.host = nullptr;
  char* top = static_cast<char*>(f.map) + kGuard + kStack;
#if defined(__x86_64__)
  // The frame moeforge_shim_switch pops: control state, six registers, then
  // the return address (fiber_main's entry, 16-byte aligned as after a call).
  uint64_t* slot = reinterpret_cast<uint64_t*>(top - 16);
  slot[0] = reinterpret_cast<uint64_t>(&fiber_main);
  uint64_t* sp = slot - 7;
  for (int i = 1; i < 7; ++i) sp[i] = 0;
  uint32_t mxcsr;
  uint16_t fpucw;
  __asm__ volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fpucw));
  std::memcpy(reinterpret_cast<char*>(sp), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  f.ctx.sp = sp;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = static_cast<char*>(f.map) + kGuard;
  f.ctx.uc.uc_stack.ss_size = kStack;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main, 0);
#endif
}

inline bool runnable(const Fiber& f) {
  if (f.done) return false;
  if (f.wait && f.wait->phase == f.wait_phase) return false;
  if (f.until && !f.until(f.until_arg, f.until_val)) return false;
  return true;
}

// Seconds a launch may run before it is declared hung (MOEFORGE_EMU_WATCHDOG_S, default 300).
inline double watchdog_seconds() {
  const char* v = std::getenv("MOEFORGE_EMU_WATCHDOG_S");
  const double s = v ? std::atof(v) : 0.0;
  return s > 0.0 ? s : 300.0;
}

// Runs `list` until every fiber finished: round-robin, a waiting fiber
// resumed once its barrier's phase completed or its predicate holds. A
// round in which nothing can run is a deadlock (on a GPU, a hang).
inline void run(const std::vector<Fiber*>& list, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  const double limit = watchdog_seconds();
  size_t left = list.size();
  for (uint64_t round = 0; left > 0; ++round) {
    bool ran = false;
    for (Fiber* f : list) {
      if (f->done) continue;
      land();
      if (!runnable(*f)) continue;
      f->wait = nullptr;
      f->until = nullptr;
      resume(*f);
      ran = true;
      if (f->done) --left;
    }
    land();
    if (!ran && left > 0) {
      std::fprintf(stderr, "shim: %s deadlocked: %zu thread(s) wait on barriers or signals nobody completes\n", what,
                   left);
      std::abort();
    }
    if ((round & 1023) == 1023 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
      std::fprintf(stderr, "shim: %s still running after %.0f s (MOEFORGE_EMU_WATCHDOG_S): hung?\n", what, limit);
      std::abort();
    }
  }
}

inline std::unique_ptr<Block> make_block(unsigned b, unsigned threads) {
  auto blk = std::make_unique<Block>();
  blk->id = b;
  blk->threads = threads;
  blk->block = std::make_unique<Barrier>(threads);
  const unsigned nwarps = (threads + 31) / 32;
  for (unsigned w = 0; w < nwarps; ++w) blk->warps.push_back(std::make_unique<Barrier>(std::min(32u, threads - 32 * w)));
  for (unsigned g = 0; g < (threads + 127) / 128; ++g)
    blk->groups.push_back(std::make_unique<Barrier>(std::min(128u, threads - 128 * g)));
  blk->slots.assign(nwarps * 32, 0);
  blk->in.assign(threads, nullptr);
  blk->out.assign(static_cast<size_t>(threads) * 4, 0);
  return blk;
}

template <typename F>
void set_body(F& call) {
  body = [](void* c) { (*static_cast<F*>(c))(); };
  body_arg = &call;
}

// Runs `kernel(args...)` over `grid` blocks of `block` threads, blocks one
// after another.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), unsigned grid, unsigned block, Args... args) {
  gdim = ShimDim3{grid, 1, 1};
  bdim = ShimDim3{block, 1, 1};
  auto call = [&] { kernel(args...); };
  set_body(call);
  std::vector<Fiber*> list(block);
  for (unsigned b = 0; b < grid; ++b) {
    auto blk = make_block(b, block);
    for (unsigned t = 0; t < block; ++t) {
      list[t] = &fiber(t);
      prepare(*list[t], blk.get(), t);
    }
    char what[64];
    std::snprintf(what, sizeof what, "block %u", b);
    run(list, what);
  }
  body = nullptr;
  body_arg = nullptr;
}

// Runs `kernel(args...)` over `grid` resident blocks of `block` threads in
// clusters of `cluster` blocks, each with `smem_bytes` of dynamic shared
// memory (zeroed, 1024-byte aligned, offset 0 of its shared window), and the
// host fibers `host` beside them, until all of them finished.
template <typename... Params, typename... Args>
void launch_resident(const std::vector<std::function<void()>>& host, void (*kernel)(Params...), unsigned grid,
                     unsigned block, unsigned cluster, size_t smem_bytes, Args... args) {
  if (cluster == 0 || grid % cluster != 0) die("a cluster launch's grid is not whole clusters");
  gdim = ShimDim3{grid, 1, 1};
  bdim = ShimDim3{block, 1, 1};
  auto call = [&] { kernel(args...); };
  set_body(call);
  std::vector<std::unique_ptr<Block>> blocks;
  std::vector<std::unique_ptr<Barrier>> cluster_barriers;
  std::vector<std::vector<Cta*>> peers(grid / cluster);
  for (unsigned b = 0; b < grid; ++b) {
    auto blk = make_block(b, block);
    const size_t bytes = (smem_bytes + 4095) / 4096 * 4096;
    if (bytes > 0) {
      blk->smem.reset(static_cast<unsigned char*>(std::aligned_alloc(4096, bytes)));
      if (!blk->smem) die("cannot allocate a block's shared memory");
      std::memset(blk->smem.get(), 0, bytes);
    }
    blk->cta = Cta{blk->smem.get(), smem_bytes, b % cluster, cluster, nullptr};
    if (b % cluster == 0) cluster_barriers.push_back(std::make_unique<Barrier>(cluster * block));
    blk->cluster_barrier = cluster_barriers.back().get();
    peers[b / cluster].push_back(&blk->cta);
    blocks.push_back(std::move(blk));
  }
  for (auto& blk : blocks) blk->cta.peers = peers[blk->id / cluster].data();
  std::vector<Fiber*> list;
  size_t n = 0;
  for (auto& blk : blocks)
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fiber(n++);
      prepare(f, blk.get(), t);
      list.push_back(&f);
    }
  for (const auto& h : host) {
    Fiber& f = fiber(n++);
    prepare(f, nullptr, 0);
    f.host = h;
    list.push_back(&f);
  }
  run(list, "resident launch");
  body = nullptr;
  body_arg = nullptr;
}

// This thread's block's dynamic shared memory.
inline unsigned char* dynamic_smem() {
  if (!current || !current->smem) die("dynamic shared memory outside a resident launch");
  return current->smem.get();
}

// Publishes `v` for this lane, then reads lane `src`'s value. Outside a
// launch the thread is its whole warp.
template <typename T>
inline T exchange(T v, int src) {
  if (!current) return v;
  uint64_t* s = &current->slots[warp() * 32];
  s[lane()] = bits(v);
  warp_barrier().arrive_and_wait();
  const T out = from_bits<T>(s[src]);
  warp_barrier().arrive_and_wait();
  return out;
}

// A warp (`threads` = 32) or warpgroup (128) collective: every thread of
// the caller's group publishes `mine`; the thread that arrives last runs
// `f(in, out)` over the group's operands (by thread within the group) and
// writes each thread's results (four words each) before any other resumes.
// Returns this thread's results.
template <typename F>
inline const uint64_t* collective(unsigned threads, const void* mine, F&& f) {
  if (!current) die("a warp-collective instruction outside a launch");
  const unsigned first = tid.x / threads * threads;
  current->in[tid.x] = mine;
  Barrier& b = threads == 32 ? *current->warps[tid.x / 32] : *current->groups[tid.x / 128];
  if (b.expected != threads) die("a collective instruction with threads of its group missing (exited or diverged)");
  if (b.arrive_and_wait()) f(&current->in[first], &current->out[static_cast<size_t>(first) * 4]);
  return &current->out[static_cast<size_t>(tid.x) * 4];
}

// bar.sync `id`, `threads`: a named barrier among `threads` threads of the block.
inline void named_barrier(unsigned id, unsigned threads) {
  if (!current) return;
  if (id == 0 && threads == current->threads) {
    current->block->arrive_and_wait();
    return;
  }
  if (id >= 16 || threads % 32 != 0 || threads == 0) die("bar.sync: barrier id or thread count out of range");
  auto& b = current->named[id];
  if (!b) b = std::make_unique<Barrier>(threads);
  if (b->arrived == 0) b->expected = threads;
  if (b->expected != threads) die("bar.sync: threads of one phase disagree on the count");
  b->arrive_and_wait();
}

// barrier.cluster.arrive + wait: every thread of every CTA of the cluster.
inline void cluster_barrier() {
  if (!current) return;
  if (!current->cluster_barrier) die("barrier.cluster outside a cluster launch");
  current->cluster_barrier->arrive_and_wait();
}

}  // namespace shim

#define threadIdx (::shim::tid)
#define blockIdx (::shim::bid)
#define blockDim (::shim::bdim)
#define gridDim (::shim::gdim)

inline void __syncthreads() {
  if (shim::current) shim::current->block->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  if (shim::current) shim::warp_barrier().arrive_and_wait();
}
inline void __threadfence() {
#if !defined(__SANITIZE_THREAD__)  // ThreadSanitizer rejects standalone fences (see ptx_host.h)
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
[[noreturn]] inline void __trap() { shim::die("__trap()"); }
inline void __nanosleep(unsigned) { shim::yield(); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline float __expf(float x) { return std::exp(x); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
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
  if (!shim::current) return pred ? 1u : 0u;
  uint64_t* s = &shim::current->slots[shim::warp() * 32];
  s[shim::lane()] = pred ? 1 : 0;
  shim::warp_barrier().arrive_and_wait();
  const unsigned lanes = std::min(32u, shim::bdim.x - 32 * shim::warp());
  unsigned out = 0;
  for (unsigned l = 0; l < lanes; ++l) out |= static_cast<unsigned>(s[l] != 0) << l;
  shim::warp_barrier().arrive_and_wait();
  return out;
}
