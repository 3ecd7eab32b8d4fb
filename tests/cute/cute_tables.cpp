// Reference layouts from CuTe (CUTLASS's headers, PyPI `nvidia-cutlass`),
// a definition of the hardware's data layouts written by NVIDIA, compiled
// for the host. Each function fills a table that layout_check.cpp compares
// with the PTX layer's emulation (runtime/shim/ptx_host.h). This file and
// the emulation share nothing: it includes only CuTe and the CUDA headers.
// Every N of wgmma m64nNk16 (8 to 256 in steps of 8), not only the common ones.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include <cstdint>

using namespace cute;

namespace {

alignas(4096) cutlass::bfloat16_t tile[256 * 64];

// Byte offsets of every (row, k) of a `Rows`×`K` bf16 tile laid out by a
// GMMA K-major atom tiled to that shape, from a 4096-aligned base.
template <class Atom, int Rows, int K>
void offsets(int32_t* out) {
  auto t = make_tensor(make_smem_ptr(tile), tile_to_shape(Atom{}, Shape<Int<Rows>, Int<K>>{}));
  for (int r = 0; r < Rows; ++r)
    for (int k = 0; k < K; ++k)
      out[r * K + k] = static_cast<int32_t>(reinterpret_cast<char*>(raw_pointer_cast(&t(r, k))) -
                                            reinterpret_cast<char*>(tile));
}

// The descriptor CuTe builds for the first K-block of such a tile (on the
// host, its start-address field is 0: CuTe cannot convert host pointers to
// shared addresses; the other fields are the layout's).
template <class Atom, int Rows, int K>
uint64_t descriptor() {
  auto t = make_tensor(make_smem_ptr(tile), tile_to_shape(Atom{}, Shape<Int<Rows>, Int<K>>{}));
  return GMMA::make_gmma_desc<GMMA::Major::K>(local_tile(t, Shape<Int<Rows>, _16>{}, make_coord(0, 0))).desc_;
}

template <class Op>
void wgmma_c(int32_t* out) {
  using L = typename MMA_Traits<Op>::CLayout;
  for (int t = 0; t < 128; ++t)
    for (int v = 0; v < size<1>(L{}); ++v) out[t * size<1>(L{}) + v] = L{}(t, v);
}

template <class Op>
void ldmatrix(int32_t* out) {
  using T = Copy_Traits<Op>;
  // (destination thread, destination bit) → (source thread, source bit), flattened as thread + 32·bit.
  auto f = composition(right_inverse(typename T::SrcLayout{}), typename T::DstLayout{});
  const int bits = size<1>(typename T::DstLayout{});
  for (int t = 0; t < 32; ++t)
    for (int v = 0; v < bits; ++v) out[t * bits + v] = f(t, v);
}

}  // namespace

template <int Rows>
int offsets_of(int mode, int32_t* out) {
  switch (mode) {
    case 1:
      offsets<GMMA::Layout_K_SW128_Atom<bfloat16_t>, Rows, 64>(out);
      return 0;
    case 2:
      offsets<GMMA::Layout_K_SW64_Atom<bfloat16_t>, Rows, 64>(out);
      return 0;
    case 3:
      offsets<GMMA::Layout_K_SW32_Atom<bfloat16_t>, Rows, 64>(out);
      return 0;
    case 0:
      offsets<GMMA::Layout_K_INTER_Atom<bfloat16_t>, Rows, 64>(out);
      return 0;
  }
  return 1;
}

// Offsets of a `rows`×64 bf16 tile (rows 64 or 256) in the K-major atom of
// swizzle mode `mode` as the wgmma descriptor names it: 1 = 128B, 2 = 64B,
// 3 = 32B, 0 = none (interleaved core matrices).
extern "C" int cute_kmajor_offsets(int mode, int rows, int k, int32_t* out) {
  if (k != 64) return 1;
  if (rows == 64) return offsets_of<64>(mode, out);
  if (rows == 256) return offsets_of<256>(mode, out);
  return 1;
}

extern "C" uint64_t cute_kmajor_descriptor(int mode) {
  switch (mode) {
    case 1:
      return descriptor<GMMA::Layout_K_SW128_Atom<bfloat16_t>, 64, 64>();
    case 2:
      return descriptor<GMMA::Layout_K_SW64_Atom<bfloat16_t>, 64, 64>();
    case 3:
      return descriptor<GMMA::Layout_K_SW32_Atom<bfloat16_t>, 64, 64>();
    case 0:
      return descriptor<GMMA::Layout_K_INTER_Atom<bfloat16_t>, 64, 64>();
  }
  return 0;
}

// wgmma m64nNk16 f32 accumulators: out[t·(N/2) + v] = row + 64·col of (thread t, value v).
extern "C" int cute_wgmma_c(int n, int32_t* out) {
  using namespace SM90::GMMA;
  using K = GMMA::Major;
  switch (n) {
    case 8: wgmma_c<MMA_64x8x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 16: wgmma_c<MMA_64x16x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 24: wgmma_c<MMA_64x24x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 32: wgmma_c<MMA_64x32x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 40: wgmma_c<MMA_64x40x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 48: wgmma_c<MMA_64x48x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 56: wgmma_c<MMA_64x56x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 64: wgmma_c<MMA_64x64x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 72: wgmma_c<MMA_64x72x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 80: wgmma_c<MMA_64x80x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 88: wgmma_c<MMA_64x88x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 96: wgmma_c<MMA_64x96x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 104: wgmma_c<MMA_64x104x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 112: wgmma_c<MMA_64x112x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 120: wgmma_c<MMA_64x120x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 128: wgmma_c<MMA_64x128x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 136: wgmma_c<MMA_64x136x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 144: wgmma_c<MMA_64x144x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 152: wgmma_c<MMA_64x152x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 160: wgmma_c<MMA_64x160x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 168: wgmma_c<MMA_64x168x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 176: wgmma_c<MMA_64x176x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 184: wgmma_c<MMA_64x184x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 192: wgmma_c<MMA_64x192x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 200: wgmma_c<MMA_64x200x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 208: wgmma_c<MMA_64x208x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 216: wgmma_c<MMA_64x216x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 224: wgmma_c<MMA_64x224x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 232: wgmma_c<MMA_64x232x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 240: wgmma_c<MMA_64x240x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 248: wgmma_c<MMA_64x248x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
    case 256: wgmma_c<MMA_64x256x16_F32BF16BF16_SS<K::K, K::K>>(out); return 0;
  }
  return 1;
}

// mma.sync m16n8k16 (bf16, f32): A (32 × 8 values) → m + 16·k, B (32 × 4) → n + 8·k, C (32 × 4) → m + 16·n.
extern "C" void cute_mma_sm80(int32_t* a, int32_t* b, int32_t* c) {
  using T = MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>;
  for (int t = 0; t < 32; ++t) {
    for (int v = 0; v < 8; ++v) a[t * 8 + v] = typename T::ALayout{}(t, v);
    for (int v = 0; v < 4; ++v) b[t * 4 + v] = typename T::BLayout{}(t, v);
    for (int v = 0; v < 4; ++v) c[t * 4 + v] = typename T::CLayout{}(t, v);
  }
}

// ldmatrix .x4 (32 × 128 bits) and .x2 (32 × 64 bits): source thread + 32·source bit of each destination bit.
extern "C" void cute_ldmatrix(int32_t* x4, int32_t* x2) {
  ldmatrix<SM75_U32x4_LDSM_N>(x4);
  ldmatrix<SM75_U32x2_LDSM_N>(x2);
}
