// GPU check of one emitted Adaptive Persistent Kernel (scripts/gpu-check.sh
// builds it with -DKERNEL_SOURCE="…/kernels/apk.cu"). Launches the
// persistent grid once, posts operations through the mailboxes as the
// attention side would, and prints one JSON object:
//   numerics: ‖y − ref‖/‖ref‖ per layout against a float64 CPU reference on
//             sampled rows (fresh random inputs, outputs poisoned first);
//   prefill:  time and TFLOP/s of a prefill-shaped operation alone;
//   static:   built with -DAPK_STATIC_TILES (the same kernel dealing tiles
//             round-robin: no claims, assignments or borrowing), this driver
//             prints only {"static_prefill_us": …}; the scheduling overhead
//             is APK / static − 1 (scripts/gpu-check.sh merges the two);
//   decode:   latency alone, and with a prefill operation posted ~10 µs before
//             it (ExpertPlex §7.3); the prefill's slowdown under sharing;
//   preempt:  first decode tile claimed − decode instantiated, under contention.
// Times come from the kernel's %globaltimer stamps (t_instantiated, t_first_claim, t_done).
// Usage: apk_check TOKENS_PREFILL TOKENS_DECODE TOP_K EXPERTS_TOTAL REPEATS
#include KERNEL_SOURCE

#include <cuda.h>          // CUtensorMap and its enums
#include <cuda_fp8.h>      // host-side e4m3 conversion for fp8 weights
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                                        \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

namespace {

using bf16 = __nv_bfloat16;

uint16_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled is not available\n");
    std::exit(2);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// fp8 e4m3 weights with one scale per 128×128 block of each matrix
// ([mats][rows][cols]): bytes, scales (row-major per matrix), and the
// dequantized values rounded to bf16 (what the kernel multiplies) for the
// reference, written back into `w`.
void quantize(std::vector<uint16_t>& w, int mats, int rows, int cols, std::vector<uint8_t>& q, std::vector<float>& sc) {
  const int br = (rows + 127) / 128, bc = (cols + 127) / 128;
  q.resize(w.size());
  sc.assign(static_cast<size_t>(mats) * br * bc, 1.0f);
  for (int m = 0; m < mats; ++m)
    for (int i = 0; i < br; ++i)
      for (int j = 0; j < bc; ++j) {
        auto at = [&](int r, int c) { return (static_cast<size_t>(m) * rows + r) * cols + c; };
        float amax = 0.0f;
        for (int r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
          for (int c = j * 128; c < std::min(cols, j * 128 + 128); ++c) amax = std::max(amax, std::fabs(from_bits(w[at(r, c)])));
        const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
        sc[(static_cast<size_t>(m) * br + i) * bc + j] = s;
        for (int r = i * 128; r < std::min(rows, i * 128 + 128); ++r)
          for (int c = j * 128; c < std::min(cols, j * 128 + 128); ++c) {
            const __nv_fp8_e4m3 v(from_bits(w[at(r, c)]) / s);
            q[at(r, c)] = v.__x;
            w[at(r, c)] = to_bits(static_cast<float>(v) * s);
          }
      }
}

struct Phase {
  uint32_t rows_cap = 0;
  bf16 *x = nullptr, *act = nullptr, *y = nullptr;
};

struct Run {
  double inst_to_done_us, first_claim_us;
  unsigned long long t_inst, t_first, t_done;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: apk_check TOKENS_PREFILL TOKENS_DECODE TOP_K EXPERTS_TOTAL REPEATS\n");
    return 2;
  }
  const int tokens_p = std::atoi(argv[1]), tokens_d = std::atoi(argv[2]), top_k = std::atoi(argv[3]);
  const int experts_total = std::atoi(argv[4]), repeats = std::max(1, std::atoi(argv[5]));
  const int H = apk::kHidden, I = apk::kInter, E = apk::kLocalExperts;
  std::mt19937_64 rng(20261130);
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));

  // Rows per local expert: each token routes to top_k of experts_total experts.
  auto counts_for = [&](int tokens, int cap) {
    std::vector<uint32_t> c(E, 0);
    std::uniform_int_distribution<int> pick(0, experts_total - 1);
    for (int t = 0; t < tokens; ++t) {
      std::vector<int> chosen;
      while (static_cast<int>(chosen.size()) < top_k) {
        const int e = pick(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int e : chosen)
        if (e < E && static_cast<int>(c[e]) < cap) ++c[e];
    }
    return c;
  };

  // Weights of two layers (operations run on layer 1, so the kernel's layer
  // offsets into weights, maps and scales are exercised) and per-phase buffers.
  // Uniform weights from a fast generator: billions of values for the large shapes.
  constexpr int L = 2, kLayer = 1;
  const size_t w13_n = static_cast<size_t>(L) * E * 2 * I * H, w2_n = static_cast<size_t>(L) * E * H * I;
  std::vector<uint16_t> w13(w13_n), w2(w2_n);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  uint64_t lcg = 0x9e3779b97f4a7c15ull;
  auto uniform = [&] {  // in [-0.035, 0.035): standard deviation ~0.02
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<float>(lcg >> 40) / 16777216.0f - 0.5f) * 0.07f;
  };
  for (auto& v : w13) v = to_bits(uniform());
  for (auto& v : w2) v = to_bits(uniform());
  // bf16 weights, or fp8 with block scales (the reference then uses the dequantized values).
  void *d_w13, *d_w2;
  float *d_s13 = nullptr, *d_s2 = nullptr;
  const size_t welt = apk::kFp8Weights ? 1 : 2;
  CHECK(cudaMalloc(&d_w13, w13_n * welt));
  CHECK(cudaMalloc(&d_w2, w2_n * welt));
  if (apk::kFp8Weights) {
    std::vector<uint8_t> q13, q2;
    std::vector<float> s13, s2;
    quantize(w13, L * E * 2, I, H, q13, s13);  // gate and up are separate [I][H] matrices
    quantize(w2, L * E, H, I, q2, s2);
    // The kernel indexes w13's scales per [2I][H] matrix: gate blocks, then up blocks.
    CHECK(cudaMemcpy(d_w13, q13.data(), w13_n, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w2, q2.data(), w2_n, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_s13, s13.size() * 4));
    CHECK(cudaMalloc(&d_s2, s2.size() * 4));
    CHECK(cudaMemcpy(d_s13, s13.data(), s13.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_s2, s2.data(), s2.size() * 4, cudaMemcpyHostToDevice));
  } else {
    CHECK(cudaMemcpy(d_w13, w13.data(), w13_n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w2, w2.data(), w2_n * 2, cudaMemcpyHostToDevice));
  }
  Phase ph[2];
  ph[apk::kPrefill].rows_cap = apk::kMaxPrefillRows;
  ph[apk::kDecode].rows_cap = static_cast<uint32_t>(E) * apk::kMaxDecodeRows;
  // The operation templates: buffers and (wgmma path) TMA descriptors, fixed before launch.
  apk::Templates tm{};
  tm.w13 = static_cast<const apk::Weight*>(d_w13);
  tm.w2 = static_cast<const apk::Weight*>(d_w2);
  tm.w13_scale = d_s13;
  tm.w2_scale = d_s2;
  for (int p = 0; p < 2; ++p) {
    const size_t rows = ph[p].rows_cap;
    CHECK(cudaMalloc(&ph[p].x, rows * H * 2));
    CHECK(cudaMalloc(&ph[p].act, rows * I * 2));
    CHECK(cudaMalloc(&ph[p].y, rows * H * 2));
    tm.phase[p].x = ph[p].x;
    tm.phase[p].act = ph[p].act;
    tm.phase[p].y = ph[p].y;
    // The TMA maps as every launcher encodes them (the emitted
    // apk::encode_tensor_maps, which the emulated device runs too): every
    // layer's matrices (layers × experts), the phase's buffer rows.
    const apk::MapShape maps{static_cast<uint32_t>(rows), static_cast<uint32_t>(H), static_cast<uint32_t>(H),
                             static_cast<uint32_t>(I), static_cast<uint32_t>(H), static_cast<uint32_t>(H),
                             static_cast<uint32_t>(I), static_cast<uint32_t>(L * E)};
    if (!apk::encode_tensor_maps(encode_fn(), tm, static_cast<uint32_t>(p), maps)) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled refused a map\n");
      std::exit(2);
    }
  }
  apk::State* st;
  CHECK(cudaMalloc(&st, sizeof(apk::State)));
  CHECK(cudaMemset(st, 0, sizeof(apk::State)));

  cudaStream_t kernel_stream, host_stream;
  CHECK(cudaStreamCreateWithFlags(&kernel_stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&host_stream, cudaStreamNonBlocking));
  // One CTA per SM, every cluster co-resident (the scheduler spins on peers).
  CHECK(cudaFuncSetAttribute(moe_apk, cudaFuncAttributeMaxDynamicSharedMemorySize, apk::kSmemBytes));
  int clusters = std::min(apk::kMaxClusters, prop.multiProcessorCount / apk::kClusterSize);
  if (apk::kClusterSize > 1) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * apk::kClusterSize));
    cfg.blockDim = dim3(apk::kThreads);
    cfg.dynamicSmemBytes = apk::kSmemBytes;
    int active = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&active, moe_apk, &cfg));
    clusters = std::min(clusters, active);
  } else {
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_apk, apk::kThreads, apk::kSmemBytes));
    clusters = std::min(clusters, per_sm * prop.multiProcessorCount);
  }
  if (clusters < 1) {
    std::fprintf(stderr, "the APK does not fit on this GPU (%d bytes of shared memory)\n", apk::kSmemBytes);
    return 2;
  }
  moe_apk<<<clusters * apk::kClusterSize, apk::kThreads, apk::kSmemBytes, kernel_stream>>>(tm, st);
  CHECK(cudaGetLastError());

  uint32_t seq[2] = {0, 0};
  auto row_begin = [&](int p, const std::vector<uint32_t>& c) {
    std::vector<uint32_t> b(E);
    uint32_t r = 0;
    for (int e = 0; e < E; ++e) {
      b[e] = p == apk::kPrefill ? r : static_cast<uint32_t>(e) * apk::kMaxDecodeRows;
      r += (c[e] + apk::kMtPrefill - 1) / apk::kMtPrefill * apk::kMtPrefill;
    }
    return b;
  };
  // Fresh random inputs for the rows an operation uses; outputs poisoned (NaN).
  auto fill = [&](int p, const std::vector<uint32_t>& c) {
    const auto b = row_begin(p, c);
    std::vector<uint16_t> host;
    for (int e = 0; e < E; ++e) {
      host.resize(static_cast<size_t>(c[e]) * H);
      for (auto& v : host) v = to_bits(nd(rng));
      CHECK(cudaMemcpyAsync(ph[p].x + static_cast<size_t>(b[e]) * H, host.data(), host.size() * 2,
                            cudaMemcpyHostToDevice, host_stream));
      CHECK(cudaMemsetAsync(ph[p].y + static_cast<size_t>(b[e]) * H, 0xff, static_cast<size_t>(c[e]) * H * 2,
                            host_stream));
    }
    CHECK(cudaStreamSynchronize(host_stream));
  };
  auto post = [&](int p, const std::vector<uint32_t>& c) {
    apk::PhaseState* s = &st->phase[p];
    const uint32_t layer = kLayer;
    CHECK(cudaMemcpyAsync(&s->layer, &layer, 4, cudaMemcpyHostToDevice, host_stream));
    CHECK(cudaMemcpyAsync(s->counts, c.data(), 4 * E, cudaMemcpyHostToDevice, host_stream));
    const uint32_t next = ++seq[p];
    CHECK(cudaMemcpyAsync(&s->posted, &next, 4, cudaMemcpyHostToDevice, host_stream));
    CHECK(cudaStreamSynchronize(host_stream));
  };
  auto wait = [&](int p) {
    apk::PhaseState* s = &st->phase[p];
    uint32_t done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (done != seq[p]) {
      CHECK(cudaMemcpyAsync(&done, &s->done, 4, cudaMemcpyDeviceToHost, host_stream));
      CHECK(cudaStreamSynchronize(host_stream));
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
        std::fprintf(stderr, "operation of phase %d did not finish in 60 s\n", p);
        std::exit(3);
      }
    }
    unsigned long long t[3];
    CHECK(cudaMemcpyAsync(t, &s->t_instantiated, sizeof(t), cudaMemcpyDeviceToHost, host_stream));
    CHECK(cudaStreamSynchronize(host_stream));
    return Run{(t[2] - t[0]) / 1e3, (t[1] - t[0]) / 1e3, t[0], t[1], t[2]};
  };
  // ‖y − ref‖ / ‖ref‖ over up to 48 sampled rows (float64 reference of bf16 inputs).
  auto check = [&](int p, const std::vector<uint32_t>& c) {
    const auto b = row_begin(p, c);
    double num = 0, den = 0;
    bool nan = false;
    std::vector<uint16_t> xr(H), yr(H);
    int sampled = 0;
    for (int e = 0; e < E && sampled < 48; ++e) {
      for (uint32_t i = 0; i < c[e] && sampled < 48; i += std::max<uint32_t>(1, c[e] / 4), ++sampled) {
        const size_t row = b[e] + i;
        CHECK(cudaMemcpy(xr.data(), ph[p].x + row * H, H * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(yr.data(), ph[p].y + row * H, H * 2, cudaMemcpyDeviceToHost));
        std::vector<double> a(I);
        for (int j = 0; j < I; ++j) {
          double g = 0, u = 0;
          for (int k = 0; k < H; ++k) {
            const size_t m = static_cast<size_t>(kLayer) * E + e;
            g += double(from_bits(xr[k])) * from_bits(w13[(m * 2 * I + j) * H + k]);
            u += double(from_bits(xr[k])) * from_bits(w13[(m * 2 * I + I + j) * H + k]);
          }
          a[j] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int h = 0; h < H; ++h) {
          double ref = 0;
          for (int j = 0; j < I; ++j)
            ref += a[j] * from_bits(w2[((static_cast<size_t>(kLayer) * E + e) * H + h) * I + j]);
          const double got = from_bits(yr[h]);
          nan = nan || std::isnan(got);
          num += (got - ref) * (got - ref);
          den += ref * ref;
        }
      }
    }
    return nan ? -1.0 : std::sqrt(num / std::max(den, 1e-300));
  };
  auto flops = [&](const std::vector<uint32_t>& c) {
    double rows = 0;
    for (uint32_t m : c) rows += m;
    return rows * (2.0 * H * 2 * I + 2.0 * I * H);
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };

#ifdef APK_STATIC_TILES
  {
    // Baseline build: the prefill operation alone, tiles dealt round-robin.
    const auto cp = counts_for(tokens_p, apk::kMaxPrefillRows);
    fill(apk::kPrefill, cp);
    std::vector<double> us;
    for (int r = 0; r < repeats + 1; ++r) {
      post(apk::kPrefill, cp);
      const double t = wait(apk::kPrefill).inst_to_done_us;
      if (r > 0) us.push_back(t);  // the first run warms up
    }
    const double err = check(apk::kPrefill, cp);
    const uint32_t one = 1;
    CHECK(cudaMemcpyAsync(&st->stop, &one, 4, cudaMemcpyHostToDevice, host_stream));
    CHECK(cudaStreamSynchronize(host_stream));
    CHECK(cudaStreamSynchronize(kernel_stream));
    CHECK(cudaGetLastError());
    std::printf("{\"static_prefill_us\": %.1f, \"static_rel_err_prefill\": %.3e}\n", median(us), err);
    return (err < 0 || err > 1e-2) ? 1 : 0;
  }
#endif
  // 1. Numerics, both layouts.
  const auto cp = counts_for(tokens_p, apk::kMaxPrefillRows);
  const auto cd = counts_for(tokens_d, apk::kMaxDecodeRows);
  fill(apk::kPrefill, cp);
  post(apk::kPrefill, cp);
  wait(apk::kPrefill);
  const double err_p = check(apk::kPrefill, cp);
  fill(apk::kDecode, cd);
  post(apk::kDecode, cd);
  wait(apk::kDecode);
  const double err_d = check(apk::kDecode, cd);

  // 2. Prefill alone and 3. decode alone (medians over repeats).
  std::vector<double> prefill_alone, decode_alone, decode_shared, prefill_shared, preempt;
  for (int r = 0; r < repeats; ++r) {
    post(apk::kPrefill, cp);
    prefill_alone.push_back(wait(apk::kPrefill).inst_to_done_us);
    post(apk::kDecode, cd);
    decode_alone.push_back(wait(apk::kDecode).inst_to_done_us);
  }
  // 4. Decode posted ~10 µs after a prefill operation.
  for (int r = 0; r < repeats; ++r) {
    post(apk::kPrefill, cp);
    std::this_thread::sleep_for(std::chrono::microseconds(10));
    post(apk::kDecode, cd);
    const Run d = wait(apk::kDecode);
    const Run p = wait(apk::kPrefill);
    decode_shared.push_back(d.inst_to_done_us);
    prefill_shared.push_back(p.inst_to_done_us);
    if (d.t_inst > p.t_inst && d.t_inst < p.t_done) preempt.push_back(d.first_claim_us);
  }
  const uint32_t one = 1;
  CHECK(cudaMemcpyAsync(&st->stop, &one, 4, cudaMemcpyHostToDevice, host_stream));
  CHECK(cudaStreamSynchronize(host_stream));
  CHECK(cudaStreamSynchronize(kernel_stream));
  CHECK(cudaGetLastError());

  const double pa = median(prefill_alone), da = median(decode_alone);
  const double ds = median(decode_shared), ps = median(prefill_shared);
  // Mean cluster-tile time: the prefill operation's tiles over the clusters that ran them.
  uint32_t mtiles = 0;
  for (uint32_t m : cp) mtiles += (m + apk::kMtPrefill - 1) / apk::kMtPrefill;
  const double tile_us = pa * clusters / std::max<uint32_t>(1, mtiles * (apk::kGateUpGroups + apk::kDownGroups));
  std::printf(
      "{\"gpu\": \"%s\", \"sms\": %d, \"clusters\": %d, \"hidden\": %d, \"inter\": %d, \"local_experts\": %d, "
      "\"prefill_rows\": %.0f, \"decode_rows\": %.0f, "
      "\"rel_err_prefill\": %.3e, \"rel_err_decode\": %.3e, "
      "\"prefill_alone_us\": %.1f, \"prefill_tflops\": %.3f, "
      "\"decode_alone_us\": %.1f, \"decode_shared_us\": %.1f, "
      "\"decode_slowdown\": %.3f, \"prefill_shared_us\": %.1f, \"prefill_slowdown\": %.3f, "
      "\"preemption_delay_us\": %.2f, \"mean_tile_us\": %.2f, \"preemption_samples\": %zu}\n",
      prop.name, prop.multiProcessorCount, clusters, H, I, E, flops(cp) / (2.0 * H * 2 * I + 2.0 * I * H),
      flops(cd) / (2.0 * H * 2 * I + 2.0 * I * H), err_p, err_d, pa, flops(cp) / (pa * 1e-6) / 1e12, da, ds,
      ds / da, ps, ps / pa, median(preempt), tile_us, preempt.size());
  return (err_p < 0 || err_d < 0 || err_p > 1e-2 || err_d > 1e-2) ? 1 : 0;
}
