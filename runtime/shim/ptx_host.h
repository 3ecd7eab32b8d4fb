// Host bodies of the PTX layer (`namespace ptx` of the emitted kernels):
// every inline-PTX instruction the kernels use, emulated in C++ from the PTX
// ISA so that the kernels' tensor-core paths run on the CPU with the data
// layouts the hardware uses:
//   - mbarrier objects as the hardware's 64-bit word (expected count,
//     pending arrivals, transaction count, phase), arrivals local and remote,
//     expect-tx and complete-tx, try_wait/test_wait parity;
//   - TMA tensor loads (cp.async.bulk.tensor 2-D and 3-D, multicast to a
//     cluster's CTAs) from maps encoded by this file's cuTensorMapEncodeTiled,
//     out-of-bounds elements zero-filled, boxes written with the map's
//     swizzle, transaction bytes completed on each destination's barrier;
//   - wgmma.mma_async m64nNk16 (f32 += bf16·bf16) with both operands read
//     through shared-memory matrix descriptors (start address, leading and
//     stride byte offsets, swizzle mode), the accumulators in each thread's
//     registers by the instruction's fragment layout, executed when
//     wgmma.wait_group retires its group;
//   - cp.async (16 bytes, zero-fill), cp.async.mbarrier.arrive.noinc,
//     ldmatrix .x4/.x2, mma.sync m16n8k16 (bf16, f32 accumulate);
//   - scoped loads, stores and atomics, fences, DSMEM (mapa, st.shared::cluster),
//     barrier.cluster, bar.sync, setmaxnreg, %globaltimer, fp8 e4m3 conversion.
// The layout functions (`ptx_layout`) are what tests/ptx_layout.rs checks
// against CuTe's definitions.
#pragma once

#include "cuda_host.h"
#include "cuda_bf16.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// ───────────────────── the driver's tensor-map encoder (host) ─────────────────────
// The types and enum values of cuda.h's cuTensorMapEncodeTiled.
typedef uint64_t cuuint64_t;
typedef uint32_t cuuint32_t;
typedef enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1 } CUresult;
typedef enum {
  CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
  CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1,
  CU_TENSOR_MAP_DATA_TYPE_UINT32 = 2,
  CU_TENSOR_MAP_DATA_TYPE_INT32 = 3,
  CU_TENSOR_MAP_DATA_TYPE_UINT64 = 4,
  CU_TENSOR_MAP_DATA_TYPE_INT64 = 5,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT64 = 8,
  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9,
} CUtensorMapDataType;
typedef enum { CU_TENSOR_MAP_INTERLEAVE_NONE = 0 } CUtensorMapInterleave;
typedef enum {
  CU_TENSOR_MAP_SWIZZLE_NONE = 0,
  CU_TENSOR_MAP_SWIZZLE_32B = 1,
  CU_TENSOR_MAP_SWIZZLE_64B = 2,
  CU_TENSOR_MAP_SWIZZLE_128B = 3,
} CUtensorMapSwizzle;
typedef enum {
  CU_TENSOR_MAP_L2_PROMOTION_NONE = 0,
  CU_TENSOR_MAP_L2_PROMOTION_L2_64B = 1,
  CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2,
  CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3,
} CUtensorMapL2promotion;
typedef enum { CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0 } CUtensorMapFloatOOBfill;
typedef struct CUtensorMap_st {
  alignas(64) uint64_t opaque[16];
} CUtensorMap;

namespace ptx_host {

// What this file's encoder writes into a map's 128 opaque bytes.
struct TensorMap {
  uint64_t magic;
  uint64_t base;
  uint64_t strides[4];  // bytes, of dimensions 1 .. rank-1
  uint32_t dims[5];
  uint16_t box[5];
  uint8_t elem_strides[5];
  uint8_t rank, elem_bytes, swizzle;
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap));
constexpr uint64_t kMapMagic = 0x4d4f45464d415031ull;

inline uint8_t elem_bytes_of(CUtensorMapDataType t) {
  switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
      return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
      return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
      return 8;
  }
  return 0;
}

}  // namespace ptx_host

// The driver's rules for a tiled map (CUDA driver API, cuTensorMapEncodeTiled):
// rank 1..5; a 16-byte aligned global address; dimensions in [1, 2^32];
// strides multiples of 16 below 2^40; boxes of 1..256 elements whose inner
// extent is a multiple of 16 bytes and, swizzled, at most the swizzle span;
// element strides 1..8.
inline CUresult cuTensorMapEncodeTiled(CUtensorMap* out, CUtensorMapDataType type, cuuint32_t rank, void* global,
                                       const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                       const cuuint32_t* elem_strides, CUtensorMapInterleave interleave,
                                       CUtensorMapSwizzle swizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  using ptx_host::TensorMap;
  const uint8_t eb = ptx_host::elem_bytes_of(type);
  if (!out || eb == 0 || rank < 1 || rank > 5 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) return CUDA_ERROR_INVALID_VALUE;
  if (reinterpret_cast<uintptr_t>(global) % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  TensorMap m{};
  m.magic = ptx_host::kMapMagic;
  m.base = reinterpret_cast<uint64_t>(global);
  m.rank = static_cast<uint8_t>(rank);
  m.elem_bytes = eb;
  m.swizzle = static_cast<uint8_t>(swizzle);
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (1ull << 32) || box[i] == 0 || box[i] > 256 || elem_strides[i] == 0 ||
        elem_strides[i] > 8)
      return CUDA_ERROR_INVALID_VALUE;
    m.dims[i] = static_cast<uint32_t>(dims[i] - 1) + 1;  // 2^32 wraps to 0: refused below
    if (m.dims[i] == 0) return CUDA_ERROR_INVALID_VALUE;
    m.box[i] = static_cast<uint16_t>(box[i]);
    m.elem_strides[i] = static_cast<uint8_t>(elem_strides[i]);
    if (i + 1 < rank) {
      if (strides[i] % 16 != 0 || strides[i] >= (1ull << 40)) return CUDA_ERROR_INVALID_VALUE;
      m.strides[i] = strides[i];
    }
  }
  const uint32_t inner = box[0] * eb;
  if (inner % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  const uint32_t span = swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : 32;
  if (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && inner > span) return CUDA_ERROR_INVALID_VALUE;
  for (cuuint32_t i = 0; i < rank; ++i)
    if (m.elem_strides[i] != 1) return CUDA_ERROR_INVALID_VALUE;  // the kernels use dense boxes only
  std::memset(out, 0, sizeof(CUtensorMap));
  std::memcpy(out, &m, sizeof m);
  return CUDA_SUCCESS;
}

// ───────────────────────────── layouts ─────────────────────────────
// The data layouts the hardware defines, as functions (checked against CuTe
// by tests/ptx_layout.rs).
namespace ptx_layout {

// Swizzle mode m of a shared-memory address (the wgmma descriptor's field:
// 0 none, 1 = 128B, 2 = 64B, 3 = 32B; a TMA map's: 3 = 128B, 2 = 64B,
// 1 = 32B): the 16-byte chunk index (bits 4..) XOR the 128-byte row index
// within the pattern (bits 7..), over 3, 2 or 1 bits.
inline uint32_t swizzle_bits_of_desc_mode(uint32_t mode) { return mode == 1 ? 3 : mode == 2 ? 2 : mode == 3 ? 1 : 0; }
inline uint32_t swizzle_bits_of_map_mode(uint32_t mode) { return mode == 3 ? 3 : mode == 2 ? 2 : mode == 1 ? 1 : 0; }
inline uint32_t swizzle(uint32_t addr, uint32_t bits) {
  const uint32_t mask = (1u << bits) - 1u;
  return addr ^ (((addr >> 7) & mask) << 4);
}

// The fields of a wgmma shared-memory matrix descriptor.
struct Desc {
  uint32_t start, lbo, sbo, base_offset, mode;
};
inline Desc decode(uint64_t d) {
  return Desc{static_cast<uint32_t>(d & 0x3FFFu) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFFu) << 4,
              static_cast<uint32_t>((d >> 32) & 0x3FFFu) << 4, static_cast<uint32_t>((d >> 49) & 7u),
              static_cast<uint32_t>(d >> 62)};
}

// The shared address of element (row, k) of a K-major operand (`row` along
// M or N, `k` along K, `elem_bytes` each) described by `desc`: the canonical
// layouts of the PTX ISA's "shared memory matrix layout". Swizzled: rows of
// the swizzle span (128, 64 or 32 bytes), 8-row groups SBO apart, the address
// swizzled; unswizzled: 8×16-byte core matrices, SBO apart along the rows
// and LBO apart along K. Returns false for what the emulation does not
// model (a base offset, or a K extent past one swizzle row).
inline bool kmajor_address(uint64_t desc, uint32_t row, uint32_t k, uint32_t elem_bytes, uint32_t& out) {
  const Desc d = decode(desc);
  if (d.base_offset != 0) return false;
  const uint32_t kb = k * elem_bytes;
  if (d.mode == 0) {
    out = d.start + (row / 8) * d.sbo + (kb / 16) * d.lbo + (row % 8) * 16 + kb % 16;
    return true;
  }
  const uint32_t bits = swizzle_bits_of_desc_mode(d.mode);
  const uint32_t span = 16u << bits;
  if (kb >= span) return false;
  out = swizzle(d.start + (row / 8) * d.sbo + (row % 8) * span + kb, bits);
  return true;
}

// wgmma m64nNk16 with f32 accumulators: register i of thread t (0..127 in
// the warpgroup) holds D[row][col].
inline void wgmma_d(uint32_t t, uint32_t i, uint32_t& row, uint32_t& col) {
  row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2);
  col = 8 * (i / 4) + 2 * (t % 4) + (i % 2);
}

// mma.sync m16n8k16 (.row.col, 16-bit A and B, f32 C/D), lane l: half h of
// A register r is A[row][k]; half h of B register r is B[k][n]; C/D register
// i is C[row][col].
inline void mma_a(uint32_t l, uint32_t r, uint32_t h, uint32_t& row, uint32_t& k) {
  row = l / 4 + 8 * (r % 2);
  k = 2 * (l % 4) + h + 8 * (r / 2);
}
inline void mma_b(uint32_t l, uint32_t r, uint32_t h, uint32_t& k, uint32_t& n) {
  k = 2 * (l % 4) + h + 8 * r;
  n = l / 4;
}
inline void mma_c(uint32_t l, uint32_t i, uint32_t& row, uint32_t& col) {
  row = l / 4 + 8 * (i / 2);
  col = 2 * (l % 4) + (i % 2);
}

// ldmatrix .m8n8 .b16: lane l supplies the address of row l % 8 of matrix
// l / 8; half h of destination register j of lane l is element
// [l / 4][2·(l % 4) + h] of matrix j.
inline uint32_t ldmatrix_row_source(uint32_t matrix, uint32_t row) { return 8 * matrix + row; }
inline void ldmatrix_dst(uint32_t l, uint32_t h, uint32_t& row, uint32_t& col) {
  row = l / 4;
  col = 2 * (l % 4) + h;
}

}  // namespace ptx_layout

namespace ptx_host {

[[noreturn]] inline void fail(const char* what) { shim::die(what); }

// The shared window: a CTA's own addresses are offsets into its shared
// memory; a shared::cluster address (mapa) carries the CTA rank in bits
// 24..30 with bit 31 set.
constexpr uint32_t kClusterBit = 0x80000000u;
inline unsigned char* shared_at(uint32_t addr, size_t bytes) {
  shim::Cta* c = shim::cta();
  if (!c) fail("a shared-memory access outside a CTA");
  uint32_t off = addr;
  if (addr & kClusterBit) {
    const uint32_t rank = (addr >> 24) & 0x7fu;
    off = addr & 0xFFFFFFu;
    if (rank != c->rank) {
      if (!c->peers || rank >= c->size) fail("a shared::cluster address names a CTA outside the cluster");
      c = c->peers[rank];
    }
  }
  if (static_cast<size_t>(off) + bytes > c->bytes) fail("a shared-memory address past the CTA's shared memory");
  return c->smem + off;
}
inline shim::Cta* cta_of(uint32_t cluster_addr) {
  shim::Cta* c = shim::cta();
  if (!c) fail("a shared-memory access outside a CTA");
  if (!(cluster_addr & kClusterBit)) return c;
  const uint32_t rank = (cluster_addr >> 24) & 0x7fu;
  if (rank == c->rank) return c;
  if (!c->peers || rank >= c->size) fail("a shared::cluster address names a CTA outside the cluster");
  return c->peers[rank];
}

// An mbarrier's 64-bit word: expected arrivals (bits 0..19), pending
// arrivals (20..39), transaction count (40..61, two's complement), phase
// parity (63).
struct MbarWord {
  uint32_t expected, pending;
  int32_t tx;
  uint32_t phase;
  static MbarWord of(uint64_t w) {
    int32_t tx = static_cast<int32_t>((w >> 40) & 0x3FFFFFu);
    if (tx & 0x200000) tx -= 0x400000;
    return MbarWord{static_cast<uint32_t>(w & 0xFFFFFu), static_cast<uint32_t>((w >> 20) & 0xFFFFFu), tx,
                    static_cast<uint32_t>(w >> 63)};
  }
  uint64_t word() const {
    return static_cast<uint64_t>(expected) | (static_cast<uint64_t>(pending) << 20) |
           (static_cast<uint64_t>(static_cast<uint32_t>(tx) & 0x3FFFFFu) << 40) | (static_cast<uint64_t>(phase) << 63);
  }
};
inline std::atomic_ref<uint64_t> mbar_ref(unsigned char* p) {
  if (reinterpret_cast<uintptr_t>(p) % 8 != 0) fail("an mbarrier not 8-byte aligned");
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(p));
}
// Applies `arrivals` and `tx` (bytes expected, positive; completed, negative)
// to the barrier; the phase completes when no arrival is pending and the
// transaction count is zero.
inline void mbar_update(unsigned char* p, uint32_t arrivals, int32_t tx) {
  auto ref = mbar_ref(p);
  uint64_t w = ref.load(std::memory_order_relaxed);
  for (;;) {
    MbarWord m = MbarWord::of(w);
    if (m.expected == 0) fail("an mbarrier used before mbarrier.init");
    if (arrivals > m.pending) fail("an mbarrier arrival past the phase's expected count");
    m.pending -= arrivals;
    const int64_t t = static_cast<int64_t>(m.tx) + tx;
    if (t > 0xFFFFF || t < -0xFFFFF) fail("an mbarrier transaction count out of range (2^20 - 1)");
    m.tx = static_cast<int32_t>(t);
    if (m.pending == 0 && m.tx == 0) {
      m.pending = m.expected;
      m.phase ^= 1u;
    }
    if (ref.compare_exchange_weak(w, m.word(), std::memory_order_acq_rel, std::memory_order_relaxed)) return;
  }
}
inline bool mbar_phase_done(const void* p, uint64_t parity) {
  const uint64_t w = std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(static_cast<const uint64_t*>(p)))
                         .load(std::memory_order_acquire);
  return (w >> 63) != parity;
}

// A warpgroup's wgmma operations, recorded when issued and executed when
// wgmma.wait_group retires their group.
struct WgmmaOp {
  uint64_t da, db;
  uint32_t n;
  bool scale_d;
  float* d[128];
};
struct WgmmaQueue {
  std::vector<WgmmaOp> ops;
  std::vector<size_t> group_end;  // ops.size() when each group was committed
  size_t executed = 0;
  uint32_t commits[128] = {};
};
inline std::vector<WgmmaQueue>& wgmma_queues() {
  // One queue per warpgroup of the running block, made on first use.
  shim::Block* b = shim::current;
  if (!b) fail("wgmma outside a launch");
  if (!b->ptx) b->ptx = std::make_shared<std::vector<WgmmaQueue>>((b->threads + 127) / 128);
  return *static_cast<std::vector<WgmmaQueue>*>(b->ptx.get());
}

inline float bf16_at(uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, shared_at(addr, 2), 2);
  return shim_bf16_to_float(__nv_bfloat16{v});
}

// D[64×N] (= or +=) A[64×16]·B[N×16]ᵀ, both K-major bf16 in shared memory.
inline void wgmma_execute(const WgmmaOp& op) {
  float a[64][16], b[256][16];
  for (uint32_t r = 0; r < 64; ++r)
    for (uint32_t k = 0; k < 16; ++k) {
      uint32_t at;
      if (!ptx_layout::kmajor_address(op.da, r, k, 2, at)) fail("wgmma: a descriptor layout the emulation does not model");
      a[r][k] = bf16_at(at);
    }
  for (uint32_t r = 0; r < op.n; ++r)
    for (uint32_t k = 0; k < 16; ++k) {
      uint32_t at;
      if (!ptx_layout::kmajor_address(op.db, r, k, 2, at)) fail("wgmma: a descriptor layout the emulation does not model");
      b[r][k] = bf16_at(at);
    }
  for (uint32_t t = 0; t < 128; ++t)
    for (uint32_t i = 0; i < op.n / 2; ++i) {
      uint32_t row, col;
      ptx_layout::wgmma_d(t, i, row, col);
      // bf16 products are exact in f32; the sum of the 16 runs in order.
      float s = 0.0f;
      for (uint32_t k = 0; k < 16; ++k) s += a[row][k] * b[col][k];
      op.d[t][i] = op.scale_d ? op.d[t][i] + s : s;
    }
}

inline uint32_t wg_thread() { return shim::tid.x % 128; }

}  // namespace ptx_host

namespace ptx {

// ───────────────────────── memory model ─────────────────────────
// Device and system scope are both this process.
template <typename T>
inline std::atomic_ref<T> at(const T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p));
}
inline uint32_t ld_acquire_sys_u32(const uint32_t* p) { return at(p).load(std::memory_order_acquire); }
inline uint32_t ld_acquire_gpu_u32(const uint32_t* p) { return at(p).load(std::memory_order_acquire); }
inline unsigned long long ld_relaxed_gpu_u64(const unsigned long long* p) { return at(p).load(std::memory_order_relaxed); }
inline unsigned long long ld_acquire_gpu_u64(const unsigned long long* p) { return at(p).load(std::memory_order_acquire); }
inline void st_release_sys_u32(uint32_t* p, uint32_t v) { at(p).store(v, std::memory_order_release); }
inline void st_release_gpu_u32(uint32_t* p, uint32_t v) { at(p).store(v, std::memory_order_release); }
inline void st_release_gpu_u64(unsigned long long* p, unsigned long long v) { at(p).store(v, std::memory_order_release); }
inline uint32_t atom_add_acq_rel_gpu_u32(uint32_t* p, uint32_t v) { return at(p).fetch_add(v, std::memory_order_acq_rel); }
inline unsigned long long atom_add_acq_rel_gpu_u64(unsigned long long* p, unsigned long long v) {
  return at(p).fetch_add(v, std::memory_order_acq_rel);
}
// Fences order this thread's accesses around the kernel's scoped atomics,
// which already carry their acquire/release orderings here (ThreadSanitizer
// rejects standalone fences and checks those orderings without them).
#if defined(__SANITIZE_THREAD__)
inline void fence(std::memory_order) {}
#else
inline void fence(std::memory_order o) { std::atomic_thread_fence(o); }
#endif
inline void fence_acq_rel_gpu_if(bool pred) {
  if (pred) fence(std::memory_order_acq_rel);
}
// The async proxy is this process's memory too: ordering the generic
// proxy's writes before the async proxy's reads is a plain fence.
inline void fence_proxy_async_global() { fence(std::memory_order_seq_cst); }
inline void fence_proxy_async_shared_cta() { fence(std::memory_order_seq_cst); }
inline void fence_mbarrier_init_release_cluster() { fence(std::memory_order_release); }
inline void nanosleep(uint32_t) { shim::yield(); }
[[noreturn]] inline void trap() { ptx_host::fail("trap (the kernel's own check failed)"); }
inline unsigned long long globaltimer() {
  return static_cast<unsigned long long>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}
// A compiler barrier on registers (an empty asm on the device): nothing to do.
template <int kRegs>
inline void fence_registers(float (&)[kRegs]) {}

// ───────────────────────── shared memory and clusters ─────────────────────────
inline uint32_t cvta_shared(const void* p) {
  shim::Cta* c = shim::cta();
  if (!c) ptx_host::fail("cvta.to.shared outside a CTA");
  const auto* q = static_cast<const unsigned char*>(p);
  if (q < c->smem || q >= c->smem + c->bytes) ptx_host::fail("cvta.to.shared of a pointer outside shared memory");
  return static_cast<uint32_t>(q - c->smem);
}
inline uint32_t cluster_ctarank() {
  shim::Cta* c = shim::cta();
  return c ? c->rank : 0;
}
inline uint32_t mapa_shared_cluster(uint32_t addr, uint32_t rank) {
  shim::Cta* c = shim::cta();
  if (!c || rank >= c->size) ptx_host::fail("mapa: CTA rank outside the cluster");
  return ptx_host::kClusterBit | (rank << 24) | (addr & 0xFFFFFFu);
}
inline void st_shared_cluster_v4_u32(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  const uint32_t v[4] = {a, b, c, d};
  std::memcpy(ptx_host::shared_at(addr, 16), v, 16);
}
inline void barrier_cluster_sync() { shim::cluster_barrier(); }
template <int kThreads>
inline void bar_sync(uint32_t id) {
  shim::named_barrier(id, kThreads);
}
// setmaxnreg: registers are not modelled; the count must be legal.
template <int kRegs>
inline void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
}
template <int kRegs>
inline void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
}

// ───────────────────────── mbarrier ─────────────────────────
inline void mbarrier_init(uint32_t bar, uint32_t count) {
  if (count == 0 || count > 0xFFFFFu) ptx_host::fail("mbarrier.init: count out of range");
  ptx_host::mbar_ref(ptx_host::shared_at(bar, 8))
      .store(ptx_host::MbarWord{count, count, 0, 0}.word(), std::memory_order_relaxed);
}
inline void mbarrier_arrive(uint32_t bar) { ptx_host::mbar_update(ptx_host::shared_at(bar, 8), 1, 0); }
inline void mbarrier_arrive_if(bool pred, uint32_t bar) {
  if (pred) mbarrier_arrive(bar);
}
inline void mbarrier_arrive_release_cluster(uint32_t cluster_bar) {
  ptx_host::mbar_update(ptx_host::shared_at(cluster_bar, 8), 1, 0);
}
inline void mbarrier_arrive_release_cluster_if(bool pred, uint32_t cluster_bar) {
  if (pred) mbarrier_arrive_release_cluster(cluster_bar);
}
inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  ptx_host::mbar_update(ptx_host::shared_at(bar, 8), 1, static_cast<int32_t>(bytes));
}
// try_wait: may suspend for a while before reporting an incomplete phase (a failed poll yields).
inline bool mbarrier_try_wait_parity_acquire_cluster(uint32_t bar, uint32_t parity) {
  if (ptx_host::mbar_phase_done(ptx_host::shared_at(bar, 8), parity)) return true;
  shim::yield();
  return false;
}
inline bool mbarrier_test_wait_parity(uint32_t bar, uint32_t parity) {
  if (ptx_host::mbar_phase_done(ptx_host::shared_at(bar, 8), parity)) return true;
  shim::yield();
  return false;
}
// The spin loops (inside PTX on the device): the scheduler tests the phase.
inline void mbarrier_wait_parity_acquire_cluster(uint32_t bar, uint32_t parity) {
  shim::park_until(ptx_host::mbar_phase_done, ptx_host::shared_at(bar, 8), parity);
}
inline void mbarrier_wait_test_parity(uint32_t bar, uint32_t parity) {
  shim::park_until(ptx_host::mbar_phase_done, ptx_host::shared_at(bar, 8), parity);
}

// ───────────────────────── TMA ─────────────────────────
namespace detail {
// Reads the box at `coords` now (zero-filled out of bounds) and lands it, swizzled, at `dst`
// in every CTA of `mask` (or this one), completing its bytes on each one's barrier at `bar`.
inline void tma_load(uint32_t dst, const void* map_ptr, const int32_t* coords, uint32_t bar, uint32_t mask,
                     bool multicast) {
  ptx_host::TensorMap m;
  std::memcpy(&m, map_ptr, sizeof m);
  if (m.magic != ptx_host::kMapMagic) ptx_host::fail("cp.async.bulk.tensor with a map cuTensorMapEncodeTiled did not write");
  if (dst % 128 != 0) ptx_host::fail("cp.async.bulk.tensor: shared destination not 128-byte aligned");
  uint32_t total = 1;
  for (int i = 0; i < m.rank; ++i) total *= m.box[i];
  const uint32_t bytes = total * m.elem_bytes;
  std::vector<unsigned char> data(bytes, 0);
  for (uint32_t e = 0; e < total; ++e) {
    uint32_t rest = e;
    uint64_t off = 0;
    bool inside = true;
    for (int i = 0; i < m.rank; ++i) {
      const int64_t c = static_cast<int64_t>(coords[i]) + rest % m.box[i];
      rest /= m.box[i];
      if (c < 0 || c >= static_cast<int64_t>(m.dims[i])) inside = false;
      off += static_cast<uint64_t>(c) * (i == 0 ? m.elem_bytes : m.strides[i - 1]);
    }
    if (inside) std::memcpy(&data[static_cast<size_t>(e) * m.elem_bytes], reinterpret_cast<const void*>(m.base + off), m.elem_bytes);
  }
  shim::Cta* self = shim::cta();
  std::vector<shim::Cta*> dests;
  if (multicast) {
    for (uint32_t r = 0; r < self->size; ++r)
      if (mask & (1u << r)) dests.push_back(self->peers ? self->peers[r] : self);
  } else {
    dests.push_back(self);
  }
  const uint32_t bits = ptx_layout::swizzle_bits_of_map_mode(m.swizzle);
  shim::in_flight([dests, data = std::move(data), dst, bar, bytes, bits, eb = m.elem_bytes] {
    for (shim::Cta* c : dests) {
      if (static_cast<size_t>(dst) + bytes > c->bytes || static_cast<size_t>(bar) + 8 > c->bytes)
        ptx_host::fail("cp.async.bulk.tensor: destination past the CTA's shared memory");
      for (uint32_t o = 0; o < bytes; o += eb) std::memcpy(c->smem + ptx_layout::swizzle(dst + o, bits), &data[o], eb);
      ptx_host::mbar_update(c->smem + bar, 0, -static_cast<int32_t>(bytes));
    }
  });
}
}  // namespace detail
inline void cp_async_bulk_tensor_2d_g2s(uint32_t dst, const void* map, int32_t c0, int32_t c1, uint32_t bar) {
  const int32_t c[2] = {c0, c1};
  detail::tma_load(dst, map, c, bar, 0, false);
}
inline void cp_async_bulk_tensor_2d_g2s_multicast(uint32_t dst, const void* map, int32_t c0, int32_t c1, uint32_t bar,
                                                  uint16_t mask) {
  const int32_t c[2] = {c0, c1};
  detail::tma_load(dst, map, c, bar, mask, true);
}
inline void cp_async_bulk_tensor_3d_g2s(uint32_t dst, const void* map, int32_t c0, int32_t c1, int32_t c2,
                                        uint32_t bar) {
  const int32_t c[3] = {c0, c1, c2};
  detail::tma_load(dst, map, c, bar, 0, false);
}

// ───────────────────────── wgmma ─────────────────────────
inline void wgmma_fence() {}
inline void wgmma_commit_group() {
  auto& q = ptx_host::wgmma_queues()[shim::tid.x / 128];
  const uint32_t c = ++q.commits[ptx_host::wg_thread()];
  if (c > q.group_end.size()) q.group_end.push_back(q.ops.size());
}
// Retires every group but the newest kPending of this thread's commits:
// their operations run now, reading shared memory as it is.
template <int kPending>
inline void wgmma_wait_group() {
  auto& q = ptx_host::wgmma_queues()[shim::tid.x / 128];
  const uint32_t c = q.commits[ptx_host::wg_thread()];
  if (c <= static_cast<uint32_t>(kPending)) return;
  const size_t end = q.group_end[c - kPending - 1];
  for (; q.executed < end; ++q.executed) ptx_host::wgmma_execute(q.ops[q.executed]);
}
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16: the warpgroup's 128
// threads meet; the operation is recorded with each thread's accumulators.
template <int N>
inline void wgmma_m64k16_f32_bf16(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t scale_d) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16: N a multiple of 8, at most 256");
  shim::collective(128, d, [&](const void* const* in, uint64_t*) {
    auto& q = ptx_host::wgmma_queues()[shim::tid.x / 128];
    ptx_host::WgmmaOp op{da, db, static_cast<uint32_t>(N), scale_d != 0, {}};
    for (int t = 0; t < 128; ++t) op.d[t] = static_cast<float*>(const_cast<void*>(in[t]));
    q.ops.push_back(op);
  });
}

// ───────────────────────── sm_80: cp.async, ldmatrix, mma.sync ─────────────────────────
// cp.async.cg.shared.global 16 bytes: `src_bytes` read now, the rest zero; lands later.
inline void cp_async_cg_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  if (dst % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) ptx_host::fail("cp.async: 16-byte copies need 16-byte alignment");
  if (src_bytes > 16) ptx_host::fail("cp.async: src-size past the copy");
  unsigned char v[16] = {};
  if (src_bytes) std::memcpy(v, src, src_bytes);
  unsigned char* p = ptx_host::shared_at(dst, 16);
  std::array<unsigned char, 16> data;
  std::memcpy(data.data(), v, 16);
  shim::in_flight([p, data] { std::memcpy(p, data.data(), 16); });
}
// Arrives once this thread's earlier cp.async copies landed (.noinc: the
// arrival counts against the barrier's expected count).
inline void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  unsigned char* p = ptx_host::shared_at(bar, 8);
  shim::in_flight([p] { ptx_host::mbar_update(p, 1, 0); });
}
namespace detail {
template <int kMatrices>
inline void ldmatrix(uint32_t* r, uint32_t addr) {
  const uint64_t* out = shim::collective(32, reinterpret_cast<const void*>(static_cast<uintptr_t>(addr)),
                                         [](const void* const* in, uint64_t* res) {
                                           for (uint32_t l = 0; l < 32; ++l)
                                             for (uint32_t j = 0; j < kMatrices; ++j) {
                                               uint32_t row, col;
                                               ptx_layout::ldmatrix_dst(l, 0, row, col);
                                               const uint32_t src = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(
                                                   in[ptx_layout::ldmatrix_row_source(j, row)]));
                                               if (src % 16 != 0) ptx_host::fail("ldmatrix: row address not 16-byte aligned");
                                               uint32_t w;
                                               std::memcpy(&w, ptx_host::shared_at(src + col * 2, 4), 4);
                                               res[l * 4 + j] = w;
                                             }
                                         });
  for (int j = 0; j < kMatrices; ++j) r[j] = static_cast<uint32_t>(out[j]);
}
}  // namespace detail
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { detail::ldmatrix<4>(r, addr); }
inline void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) { detail::ldmatrix<2>(r, addr); }
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: C += A·B over the warp.
inline void mma_m16n8k16_f32_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Lane {
    uint32_t a[4], b[2];
    float c[4];
  } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}};
  const uint64_t* out = shim::collective(32, &mine, [](const void* const* in, uint64_t* res) {
    float A[16][16], B[16][8], C[16][8];
    auto half = [](uint32_t w, uint32_t h) { return shim_bf16_to_float(__nv_bfloat16{static_cast<uint16_t>(w >> (16 * h))}); };
    for (uint32_t l = 0; l < 32; ++l) {
      const Lane& x = *static_cast<const Lane*>(in[l]);
      for (uint32_t r = 0; r < 4; ++r)
        for (uint32_t h = 0; h < 2; ++h) {
          uint32_t row, k;
          ptx_layout::mma_a(l, r, h, row, k);
          A[row][k] = half(x.a[r], h);
        }
      for (uint32_t r = 0; r < 2; ++r)
        for (uint32_t h = 0; h < 2; ++h) {
          uint32_t k, n;
          ptx_layout::mma_b(l, r, h, k, n);
          B[k][n] = half(x.b[r], h);
        }
      for (uint32_t i = 0; i < 4; ++i) {
        uint32_t row, col;
        ptx_layout::mma_c(l, i, row, col);
        C[row][col] = x.c[i];
      }
    }
    for (uint32_t l = 0; l < 32; ++l)
      for (uint32_t i = 0; i < 4; ++i) {
        uint32_t row, col;
        ptx_layout::mma_c(l, i, row, col);
        float s = 0.0f;
        for (uint32_t k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
        res[l * 4 + i] = shim::bits(C[row][col] + s);
      }
  });
  for (int i = 0; i < 4; ++i) c[i] = shim::from_bits<float>(out[i]);
}

// ───────────────────────── fp8 ─────────────────────────
// e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN), exactly.
inline float e4m3_to_float(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man) / 8.0f, -6);
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}
// cvt.rn.f16x2.e4m3x2 then to f32: element 0 is the pair's low byte.
inline float2 cvt_e4m3x2_f32x2(uint16_t pair) {
  return float2{e4m3_to_float(static_cast<uint8_t>(pair & 0xff)), e4m3_to_float(static_cast<uint8_t>(pair >> 8))};
}

}  // namespace ptx
