// Drives an emitted dense APK (the one-group GEMM form) on the host, its
// tensor-core path through the PTX layer's emulation (runtime/shim/ptx_host.h),
// the way a colocated rank launches it: per operation, with the operation
// and `stop` posted before the launch, the grid resident with every CUDA
// thread a fiber, the launch returning once the operation is done.
// Each operation has a seeded random shape: n output columns (not a multiple
// of the tile), k (not a multiple of the stage depth), rows (not a multiple
// of M_t), x and y at a column offset inside wider rows, and one of the four
// epilogues; fp8 instances read e4m3 codes with one f32 scale per 128×128
// block (SwiGLU's n then a multiple of 128, k of 16). Checks, against a
// plain triple loop written here over the weights as the tensor cores see
// them (bf16, or each code times its block's scale rounded to bf16):
//   - every output element of the operation's rows and columns is x·Wᵀ
//     (SwiGLU: SiLU(x·Wgᵀ)·(x·Wuᵀ)), stored as bf16 or f32, or added in f32;
//   - nothing outside those rows and columns is written (sentinels);
//   - every tile ran exactly once, and the launch returned (no deadlock).
// Usage: dense SEED CLUSTERS OPS
#include KERNEL_SOURCE
#include "apk_driver.h"

#include <chrono>
#include <cmath>
#include <map>
#include <random>

namespace {

uint16_t bf16_bits(float f) { return shim_float_to_bf16(f).bits; }
float bf(uint16_t b) { return shim_bf16_to_float(__nv_bfloat16{b}); }

int fail_check(const char* what) {
  std::fprintf(stderr, "FAILED: %s\n", what);
  return 1;
}

constexpr uint16_t kSentinelBf16 = 0x7fa1;  // a NaN no epilogue writes
constexpr float kSentinelF32 = -12345.5f;

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return fail_check("usage: dense SEED CLUSTERS OPS");
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const uint32_t clusters = static_cast<uint32_t>(std::atoi(argv[2]));
  const int n_ops = std::atoi(argv[3]);
  if (clusters == 0 || clusters > static_cast<uint32_t>(apk::kMaxClusters)) return fail_check("bad cluster count");
  std::mt19937_64 rng(seed);
  auto uni = [&](uint32_t lo, uint32_t hi) { return lo + static_cast<uint32_t>(rng() % (hi - lo + 1)); };
  auto rnd = [&] { return std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng); };
  double worst = 0.0;
  uint64_t checked = 0;
  std::map<uint32_t, int> epilogues;

  for (int i = 0; i < n_ops; ++i) {
    const uint32_t ph = static_cast<uint32_t>(rng() % 2);
    const uint32_t epi = static_cast<uint32_t>(rng() % 4);
    const bool swiglu = epi == apk::kSwiGlu;
    const bool f32 = epi == apk::kStoreF32 || epi == apk::kAddF32;
    const uint32_t n = apk::kFp8Weights && swiglu ? 128 * uni(1, 2) : 2 * uni(1, 3 * apk::kNtDown / 2);
    const uint32_t k = apk::kFp8Weights ? 16 * uni(1, 3 * apk::kBk / 16 + 1) : 8 * uni(1, 3 * apk::kBk / 8 + 1);
    const uint32_t x_col = 8 * uni(0, 2), y_col = 2 * uni(0, 5);
    const uint32_t ld_x = x_col + k + 8 * uni(0, 2), ld_y = y_col + n + 2 * uni(0, 3);
    const uint32_t cap = ph == apk::kPrefill ? apk::kMaxPrefillRows : apk::kMaxDecodeRows;
    const uint32_t rows = uni(1, std::min<uint32_t>(cap, 3 * apk::kMtPrefill + 5));
    const uint32_t buf_rows = rows + 3;  // rows past the operation's stay untouched
    ++epilogues[epi];

    const uint32_t wrows = (swiglu ? 2 : 1) * n;
    std::vector<uint16_t> x(static_cast<size_t>(buf_rows) * ld_x), w(static_cast<size_t>(wrows) * k);
    for (auto& v : x) v = bf16_bits(rnd());
    // fp8: random codes (no NaN) and positive block scales; `w` then holds
    // what the tensor cores multiply (code × scale, rounded to bf16).
    std::vector<uint8_t> codes(apk::kFp8Weights ? w.size() : 0);
    const uint32_t scale_cols = (k + 127) / 128;
    std::vector<float> scales(apk::kFp8Weights ? static_cast<size_t>((wrows + 127) / 128) * scale_cols : 0);
    for (auto& v : scales) v = 0.001f + 0.002f * (rnd() + 0.5f);
    for (size_t j = 0; j < w.size(); ++j) {
      if (!apk::kFp8Weights) {
        w[j] = bf16_bits(rnd() * 0.3f);
        continue;
      }
      uint8_t b;
      do b = static_cast<uint8_t>(rng()); while ((b & 0x7f) == 0x7f);
      codes[j] = b;
      const size_t r = j / k, c = j % k;
      w[j] = bf16_bits(ptx::e4m3_to_float(b) * scales[r / 128 * scale_cols + c / 128]);
    }
    std::vector<uint16_t> yb(f32 ? 0 : static_cast<size_t>(buf_rows) * ld_y, kSentinelBf16);
    std::vector<float> yf(f32 ? static_cast<size_t>(buf_rows) * ld_y : 0, kSentinelF32);
    std::vector<float> base(yf.size());
    if (epi == apk::kAddF32) {
      for (size_t j = 0; j < yf.size(); ++j) yf[j] = rnd();
      base = yf;
    }

    apk::Templates tm{};
    tm.phase[ph].x = reinterpret_cast<const __nv_bfloat16*>(x.data() + x_col);
    tm.phase[ph].y = f32 ? static_cast<void*>(yf.data() + y_col) : static_cast<void*>(yb.data() + y_col);
    (swiglu ? tm.w13 : tm.w2) = apk::kFp8Weights ? reinterpret_cast<const apk::Weight*>(codes.data())
                                                 : reinterpret_cast<const apk::Weight*>(w.data());
    if (apk::kFp8Weights) (swiglu ? tm.w13_scale : tm.w2_scale) = scales.data();
    auto state = std::make_unique<apk::State>();
    std::memset(state.get(), 0, sizeof(apk::State));
    apk::State* st = state.get();
    // The per-operation launch: the operation and `stop` before the grid starts.
    st->phase[ph].layer = 0;
    st->phase[ph].counts[0] = rows;
    st->phase[ph].shape = apk::DenseShape{n, k, ld_x, ld_y, epi};
    st->phase[ph].posted = 1;
    st->stop = 1;

    if (!apk_driver::maps(tm, ph, apk::MapShape{rows, k, ld_x, n, k, n, k, 1})) {
      std::fprintf(stderr, "FAILED: operation %d: a tensor map was refused\n", i);
      return 1;
    }
    std::vector<apk_host::Event> log;
    apk_driver::run(tm, st, clusters, log);
    if (ptx::ld_acquire_sys_u32(&st->phase[ph].done) != 1)
      return fail_check("the launch returned before its operation was done");

    // Every tile exactly once.
    std::map<uint32_t, int> starts;
    for (auto& e : log)
      if (e.kind == apk_host::Ev::start && e.b == ph) ++starts[e.c];
    const uint32_t m_t = ph == apk::kPrefill ? apk::kMtPrefill : apk::kMtDecode;
    const uint32_t per = (swiglu ? apk::kInterPerTile : apk::kNtDown) * apk::kClusterSize;
    const uint32_t tiles = (rows + m_t - 1) / m_t * ((n + per - 1) / per);
    if (starts.size() != tiles) {
      std::fprintf(stderr, "FAILED: operation %d ran %zu distinct tiles of %u\n", i, starts.size(), tiles);
      return 1;
    }
    for (auto& [t, c] : starts)
      if (c != 1 || t >= tiles) {
        std::fprintf(stderr, "FAILED: operation %d ran tile %u %d times\n", i, t, c);
        return 1;
      }

    // The outputs against a plain triple loop (double sums; the kernel's are f32).
    for (uint32_t r = 0; r < buf_rows; ++r) {
      for (uint32_t c = 0; c < ld_y; ++c) {
        const size_t at = static_cast<size_t>(r) * ld_y + c;
        const float got = f32 ? yf[at] : bf(yb[at]);
        const bool inside = r < rows && c >= y_col && c < y_col + n;
        if (!inside) {
          const bool untouched = f32 ? (epi == apk::kAddF32 ? yf[at] == base[at] : yf[at] == kSentinelF32)
                                     : yb[at] == kSentinelBf16;
          if (!untouched) {
            std::fprintf(stderr, "FAILED: operation %d wrote row %u column %u outside its outputs\n", i, r, c);
            return 1;
          }
          continue;
        }
        const uint32_t j = c - y_col;
        auto dot = [&](uint32_t wrow) {
          double s = 0.0;
          for (uint32_t q = 0; q < k; ++q)
            s += static_cast<double>(bf(x[static_cast<size_t>(r) * ld_x + x_col + q])) * bf(w[static_cast<size_t>(wrow) * k + q]);
          return s;
        };
        double want = 0.0;
        if (swiglu) {
          const double g = dot(j), u = dot(n + j);
          want = g / (1.0 + std::exp(-g)) * u;
        } else {
          want = dot(j);
          if (epi == apk::kAddF32) want += base[at];
        }
        // bf16 outputs carry one rounding (2^-8 relative); f32 sums differ in order only.
        const double tol = f32 ? 1e-4 * (1.0 + std::fabs(want)) : 8e-3 * (1.0 + std::fabs(want));
        const double err = std::fabs(static_cast<double>(got) - want);
        if (!(err <= tol)) {
          std::fprintf(stderr, "FAILED: operation %d (epilogue %u, n %u, k %u, rows %u) row %u column %u: %g, want %g\n",
                       i, epi, n, k, rows, r, j, static_cast<double>(got), want);
          return 1;
        }
        worst = std::max(worst, err / (1.0 + std::fabs(want)));
        ++checked;
      }
    }
  }
  std::printf("ops=%d checked=%llu worst_rel_err_ppm=%.0f", n_ops, static_cast<unsigned long long>(checked), worst * 1e6);
  for (auto& [e, c] : epilogues) std::printf(" epilogue_%u=%d", e, c);
  std::printf("\n");
  return 0;
}
