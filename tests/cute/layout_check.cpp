// Holds the PTX layer's emulation (runtime/shim/ptx_host.h) to CuTe's
// definitions of the same layouts (cute_tables.cpp, linked beside it):
//   1. TMA: a box written with 128B / 64B / 32B swizzling lands where CuTe's
//      GMMA K-major atoms place each element;
//   2. wgmma descriptors: the emulation's decoder, given CuTe's descriptor
//      fields and each K-block's start, reads every (row, k) where CuTe's
//      layout has it, in all four modes; the emitted kernel's descriptor
//      (apk::smem_desc of KERNEL_SOURCE) has CuTe's 128B fields;
//   3. fragments: wgmma's accumulator (thread, register) → (row, column) for
//      every N from 8 to 256; mma.sync m16n8k16's A, B and C; ldmatrix .x4
//      and .x2 (destination bit → source row and bit);
//   4. end to end, in a fiber launch: wgmma over CuTe-laid tiles through the
//      kernel's descriptors, and ldmatrix + mma.sync over a padded tile,
//      equal a plain matrix product.
// Prints one line of counts; exits non-zero naming the first mismatch.
#include KERNEL_SOURCE

#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" int cute_kmajor_offsets(int mode, int rows, int k, int32_t* out);
extern "C" uint64_t cute_kmajor_descriptor(int mode);
extern "C" int cute_wgmma_c(int n, int32_t* out);
extern "C" void cute_mma_sm80(int32_t* a, int32_t* b, int32_t* c);
extern "C" void cute_ldmatrix(int32_t* x4, int32_t* x2);

namespace {

long checked = 0;

[[noreturn]] void mismatch(const char* what, long a, long b, long c, long got, long want) {
  std::fprintf(stderr, "FAILED: %s (%ld, %ld, %ld): emulation %ld, CuTe %ld\n", what, a, b, c, got, want);
  std::exit(1);
}
void expect(bool ok, const char* what, long a, long b, long c, long got, long want) {
  if (!ok) mismatch(what, a, b, c, got, want);
  ++checked;
}

constexpr int kRows = 64, kK = 64;
alignas(4096) unsigned char smem[1 << 17];

shim::Cta cta_of_buffer() { return shim::Cta{smem, sizeof smem, 0, 1, nullptr}; }

std::vector<int32_t> offsets(int mode, int rows) {
  std::vector<int32_t> o(static_cast<size_t>(rows) * kK);
  if (cute_kmajor_offsets(mode, rows, kK, o.data()) != 0) mismatch("CuTe has no table for mode", mode, rows, 0, 0, 0);
  return o;
}

// 1. TMA boxes against CuTe's atoms.
void tma_boxes() {
  const struct {
    int map_mode, desc_mode, span;
  } modes[] = {{CU_TENSOR_MAP_SWIZZLE_128B, 1, 64}, {CU_TENSOR_MAP_SWIZZLE_64B, 2, 32}, {CU_TENSOR_MAP_SWIZZLE_32B, 3, 16}};
  std::vector<uint16_t> global(static_cast<size_t>(kRows) * kK);
  for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<uint16_t>(i + 1);
  shim::Cta cta = cta_of_buffer();
  shim::outside_cta = &cta;
  for (const auto& m : modes) {
    std::memset(smem, 0, sizeof smem);
    alignas(64) CUtensorMap map;
    const cuuint64_t dims[2] = {kK, kRows}, strides[1] = {kK * 2};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(m.span), kRows}, ones[2] = {1, 1};
    if (cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, global.data(), dims, strides, box, ones,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(m.map_mode),
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      mismatch("cuTensorMapEncodeTiled refused a box", m.map_mode, 0, 0, 0, 0);
    const uint32_t bar = 1 << 16;
    ptx::mbarrier_init(bar, 1);
    ptx::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(m.span * kRows * 2));
    ptx::cp_async_bulk_tensor_2d_g2s(0, &map, 0, 0, bar);
    expect(ptx_host::mbar_phase_done(smem + bar, 0), "the box's bytes completed the barrier's phase", m.map_mode, 0, 0, 0, 1);
    const auto cute = offsets(m.desc_mode, kRows);
    for (int r = 0; r < kRows; ++r)
      for (int k = 0; k < m.span; ++k) {
        uint16_t v;
        std::memcpy(&v, smem + cute[static_cast<size_t>(r) * kK + k], 2);
        expect(v == global[static_cast<size_t>(r) * kK + k], "TMA box element at CuTe's offset", m.map_mode, r, k, v,
               global[static_cast<size_t>(r) * kK + k]);
      }
  }
  shim::outside_cta = nullptr;
}

// 2. Descriptors: the decoder against CuTe's layouts; the kernel's fields against CuTe's.
void descriptors() {
  for (int mode : {1, 2, 3, 0}) {
    const auto cute = offsets(mode, kRows);
    const uint64_t fields = cute_kmajor_descriptor(mode) & ~0x3FFFull;
    for (int kk = 0; kk < kK / 16; ++kk) {
      const uint64_t desc = fields | (static_cast<uint64_t>(cute[static_cast<size_t>(16 * kk)]) >> 4);
      for (int r = 0; r < kRows; ++r)
        for (int k = 0; k < 16; ++k) {
          uint32_t at = 0;
          const bool ok = ptx_layout::kmajor_address(desc, static_cast<uint32_t>(r), static_cast<uint32_t>(k), 2, at);
          expect(ok, "the decoder models CuTe's descriptor", mode, kk, r, 0, 1);
          expect(static_cast<int32_t>(at) == cute[static_cast<size_t>(r) * kK + 16 * kk + k], "descriptor address", mode,
                 r, 16 * kk + k, at, cute[static_cast<size_t>(r) * kK + 16 * kk + k]);
        }
    }
  }
  // The kernel's descriptor of a tile at shared offset 2048 + 32·kk.
  shim::Cta cta = cta_of_buffer();
  shim::outside_cta = &cta;
  const uint64_t cute128 = cute_kmajor_descriptor(1);
  for (int kk = 0; kk < 4; ++kk) {
    const auto* p = reinterpret_cast<const __nv_bfloat16*>(smem + 2048 + 32 * kk);
    const uint64_t d = apk::smem_desc(p);
    expect((d & ~0x3FFFull) == (cute128 & ~0x3FFFull), "the kernel's descriptor fields", kk, 0, 0,
           static_cast<long>(d >> 14), static_cast<long>(cute128 >> 14));
    expect((d & 0x3FFF) == static_cast<uint64_t>((2048 + 32 * kk) >> 4), "the kernel's descriptor start", kk, 0, 0,
           static_cast<long>(d & 0x3FFF), (2048 + 32 * kk) >> 4);
  }
  shim::outside_cta = nullptr;
}

// 3. Fragments.
void fragments() {
  std::vector<int32_t> c(128 * 128);
  for (uint32_t n = 8; n <= 256; n += 8) {
    if (cute_wgmma_c(static_cast<int>(n), c.data()) != 0) mismatch("CuTe has no wgmma N", n, 0, 0, 0, 0);
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < n / 2; ++i) {
        uint32_t row, col;
        ptx_layout::wgmma_d(t, i, row, col);
        const int32_t want = c[t * (n / 2) + i];
        expect(static_cast<int32_t>(row + 64 * col) == want, "wgmma accumulator", n, t, i, row + 64 * col, want);
      }
  }
  int32_t a[32 * 8], b[32 * 4], cc[32 * 4];
  cute_mma_sm80(a, b, cc);
  for (uint32_t l = 0; l < 32; ++l) {
    for (uint32_t v = 0; v < 8; ++v) {
      uint32_t row, k;
      ptx_layout::mma_a(l, v / 2, v % 2, row, k);
      expect(static_cast<int32_t>(row + 16 * k) == a[l * 8 + v], "mma.sync A", l, v / 2, v % 2, row + 16 * k, a[l * 8 + v]);
    }
    for (uint32_t v = 0; v < 4; ++v) {
      uint32_t k, n;
      ptx_layout::mma_b(l, v / 2, v % 2, k, n);
      expect(static_cast<int32_t>(n + 8 * k) == b[l * 4 + v], "mma.sync B", l, v / 2, v % 2, n + 8 * k, b[l * 4 + v]);
      uint32_t row, col;
      ptx_layout::mma_c(l, v, row, col);
      expect(static_cast<int32_t>(row + 16 * col) == cc[l * 4 + v], "mma.sync C", l, v, 0, row + 16 * col, cc[l * 4 + v]);
    }
  }
  std::vector<int32_t> x4(32 * 128), x2(32 * 64);
  cute_ldmatrix(x4.data(), x2.data());
  for (uint32_t matrices : {4u, 2u}) {
    const auto& table = matrices == 4 ? x4 : x2;
    for (uint32_t l = 0; l < 32; ++l)
      for (uint32_t j = 0; j < matrices; ++j)
        for (uint32_t bit = 0; bit < 32; ++bit) {
          uint32_t row, col;
          ptx_layout::ldmatrix_dst(l, bit / 16, row, col);
          const int32_t src_lane = static_cast<int32_t>(ptx_layout::ldmatrix_row_source(j, row));
          const int32_t src_bit = static_cast<int32_t>(col * 16 + bit % 16);
          const int32_t want = table[l * matrices * 32 + j * 32 + bit];
          expect(src_lane + 32 * src_bit == want, "ldmatrix", matrices, l, j * 32 + bit, src_lane + 32 * src_bit, want);
        }
  }
}

uint16_t bfb(float f) { return shim_float_to_bf16(f).bits; }

// 4. End to end in fiber launches.
template <int N>
void wgmma_product() {
  // A (64×64) at shared offset 0 and B (N×64) at 16384, each as CuTe's 128B
  // tiles; every value a small integer, so every product and sum is exact.
  std::vector<float> A(64 * 64), B(static_cast<size_t>(N) * 64);
  for (size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>(static_cast<int>((i * 7) % 9) - 4);
  for (size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>(static_cast<int>((i * 5) % 7) - 3);
  static std::vector<float> out;
  out.assign(128 * (N / 2), 0.0f);
  struct Args {
    std::vector<int32_t> a_off, b_off;
    const std::vector<float>*A, *B;
  } args{offsets(1, 64), offsets(1, 256), &A, &B};
  auto kernel = [](const Args* g) {
    unsigned char* s = shim::dynamic_smem();
    const uint32_t t = threadIdx.x;
    if (t == 0) {
      for (int r = 0; r < 64; ++r)
        for (int k = 0; k < 64; ++k) {
          const uint16_t v = bfb((*g->A)[static_cast<size_t>(r) * 64 + k]);
          std::memcpy(s + g->a_off[static_cast<size_t>(r) * 64 + k], &v, 2);
        }
      for (int r = 0; r < N; ++r)
        for (int k = 0; k < 64; ++k) {
          const uint16_t v = bfb((*g->B)[static_cast<size_t>(r) * 64 + k]);
          std::memcpy(s + 16384 + g->b_off[static_cast<size_t>(r) * 64 + k], &v, 2);
        }
    }
    __syncthreads();
    float d[N / 2];
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    ptx::wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      const auto* a = reinterpret_cast<const __nv_bfloat16*>(s + 32 * kk);
      const auto* b = reinterpret_cast<const __nv_bfloat16*>(s + 16384 + 32 * kk);
      ptx::wgmma_m64k16_f32_bf16<N>(d, apk::smem_desc(a), apk::smem_desc(b), 1u);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
    for (int i = 0; i < N / 2; ++i) out[t * (N / 2) + i] = d[i];
  };
  void (*entry)(const Args*) = kernel;
  shim::launch_resident({}, entry, 1, 128, 1, 1 << 17, &args);
  std::vector<int32_t> c(128 * (N / 2));
  cute_wgmma_c(N, c.data());
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < N / 2; ++i) {
      const int row = c[t * (N / 2) + i] % 64, col = c[t * (N / 2) + i] / 64;
      float want = 0.0f;
      for (int k = 0; k < 64; ++k) want += A[static_cast<size_t>(row) * 64 + k] * B[static_cast<size_t>(col) * 64 + k];
      const float got = out[static_cast<size_t>(t) * (N / 2) + i];
      expect(got == want, "wgmma product", N, row, col, static_cast<long>(got), static_cast<long>(want));
    }
}

// ldmatrix (A: 16×16 with .x4, B: 8×16 with .x2, rows padded to 24
// elements as the portable path pads them) then mma.sync.
void mma_sync_product() {
  constexpr int kLd = 24;
  static float out[32][4];
  auto kernel = [] {
    unsigned char* s = shim::dynamic_smem();
    auto* a = reinterpret_cast<uint16_t*>(s);
    auto* b = reinterpret_cast<uint16_t*>(s + 16 * kLd * 2);
    const uint32_t l = threadIdx.x;
    if (l == 0) {
      for (int r = 0; r < 16; ++r)
        for (int k = 0; k < 16; ++k) a[r * kLd + k] = bfb(static_cast<float>((r * 3 + k) % 5 - 2));
      for (int n = 0; n < 8; ++n)
        for (int k = 0; k < 16; ++k) b[n * kLd + k] = bfb(static_cast<float>((n * 5 + k * 2) % 7 - 3));
    }
    __syncwarp();
    uint32_t ra[4], rb[2];
    ptx::ldmatrix_x4(ra, ptx::cvta_shared(a + (l % 16) * kLd + (l / 16) * 8));
    ptx::ldmatrix_x2(rb, ptx::cvta_shared(b + (l % 8) * kLd + ((l / 8) % 2) * 8));
    float c[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    ptx::mma_m16n8k16_f32_bf16(c, ra, rb);
    for (int i = 0; i < 4; ++i) out[l][i] = c[i];
  };
  void (*entry)() = kernel;
  shim::launch_resident({}, entry, 1, 32, 1, 4096);
  int32_t a[32 * 8], b[32 * 4], cc[32 * 4];
  cute_mma_sm80(a, b, cc);
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      const int row = cc[l * 4 + i] % 16, col = cc[l * 4 + i] / 16;
      float want = 1.0f;
      for (int k = 0; k < 16; ++k)
        want += static_cast<float>((row * 3 + k) % 5 - 2) * static_cast<float>((col * 5 + k * 2) % 7 - 3);
      expect(out[l][i] == want, "ldmatrix + mma.sync product", l, row, col, static_cast<long>(out[l][i]),
             static_cast<long>(want));
    }
}

}  // namespace

int main() {
  tma_boxes();
  descriptors();
  fragments();
  wgmma_product<8>();
  wgmma_product<64>();
  wgmma_product<128>();
  wgmma_product<256>();
  mma_sync_product();
  std::printf("layouts checked against CuTe: %ld\n", checked);
  return 0;
}
