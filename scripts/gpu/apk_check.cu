// GPU check of one emitted Adaptive Persistent Kernel (scripts/gpu-check.sh
// builds it with -DKERNEL_SOURCE="…/kernels/apk.cu"). Launches the
// persistent grid once, posts operations through the mailboxes as the
// attention side would, stops the grid, then checks every output row of every
// checked operation against an independent reference and prints one JSON
// object.
//
// Numerics (every valid output row, not a sample):
//   prefill and decode operations on routed row counts; edge counts (empty
//   experts, 1 row, M_t − 1, M_t, M_t + 1, 2·M_t + 1; decode up to its masked
//   capacity); a contended pair (decode posted ~10 µs after prefill); the same
//   operation re-instantiated three times with fresh inputs. Inputs are fresh
//   random values for every operation; outputs are poisoned (NaN) by a host
//   copy before each post, never by a memset kernel (it could not start while
//   the persistent grid holds every SM). The reference is a plain CUDA-core
//   kernel (f32 accumulation of the bf16 values the tensor cores see, one
//   block per row), run after the persistent grid stopped, itself checked
//   against a float64 CPU computation on sampled rows. Any NaN (an unwritten
//   or wrong row) fails the check.
// Timing (%globaltimer stamps written by the kernel: t_instantiated,
// t_first_claim, t_done): prefill alone (TFLOP/s), decode alone, decode
// posted ~10 µs after a prefill (ExpertPlex §7.3) and both slowdowns, and the
// preemption delay (decode instantiated → its first tile claimed). The
// sharing is timed twice: with TOKENS_DECODE routed tokens, and with a decode
// whose footprint is the plan's expected x*_moe (X_STAR), the one the decode
// SM budget q was searched for: Eq. 4 scales the decode's clusters by
// x_moe / x*, so a decode far below x* gets few of them.
// -DAPK_STATIC_TILES builds the static-schedule baseline (tiles dealt
// round-robin); this driver then prints {"static_prefill_us", …} only.
// A sweep of prefill sizes gives the APK's measured latency profile (the
// `moe` component of `moeforge compile --profile`), written to PROFILE.
// The routed prefill counts are written to COUNTS for the torch baseline.
// A watchdog (alarm) names the step that hung and exits 3.
//
// Usage: apk_check TOKENS_PREFILL TOKENS_DECODE TOP_K EXPERTS_TOTAL REPEATS COUNTS PROFILE X_STAR
#include KERNEL_SOURCE

#include <cuda.h>          // CUtensorMap and its enums
#include <cuda_fp8.h>      // host-side e4m3 conversion for fp8 weights
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

const char* volatile g_step = "start";
void on_alarm(int) {
  const char* s = g_step;
  const char head[] = "watchdog: no progress in step ";
  (void)!write(2, head, sizeof(head) - 1);
  (void)!write(2, s, std::strlen(s));
  (void)!write(2, "\n", 1);
  _exit(3);
}
// Each step re-arms the watchdog with its own budget.
void step(const char* name, unsigned seconds) {
  g_step = name;
  alarm(seconds);
}

#define CHECK(x)                                                                                        \
  do {                                                                                                  \
    cudaError_t e_ = (x);                                                                               \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "CUDA error %s at %s:%d (step %s): %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, g_step, cudaGetErrorString(e_));                                           \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)

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

// The reference: one block per row r of `rows` (expert ids in `expert`),
// act = SiLU(x·W1ᵀ)·(x·W3ᵀ) rounded to bf16 (the APK stores act as bf16),
// then y = act·W2ᵀ, f32 accumulation on CUDA cores. Weights are the
// bf16 values the kernel multiplies ([experts][2I][H], [experts][H][I]).
__global__ void reference_rows(const uint16_t* x, const int* expert, const uint16_t* w13, const uint16_t* w2,
                               float* y, int H, int I) {
  extern __shared__ float act[];
  const int r = blockIdx.x, e = expert[r];
  const uint16_t* xr = x + static_cast<size_t>(r) * H;
  auto f = [](uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); };
  for (int j = threadIdx.x; j < I; j += blockDim.x) {
    const uint16_t* g = w13 + (static_cast<size_t>(e) * 2 * I + j) * H;
    const uint16_t* u = w13 + (static_cast<size_t>(e) * 2 * I + I + j) * H;
    float sg = 0.0f, su = 0.0f;
    for (int k = 0; k < H; ++k) {
      const float xv = f(xr[k]);
      sg = fmaf(xv, f(g[k]), sg);
      su = fmaf(xv, f(u[k]), su);
    }
    act[j] = __bfloat162float(__float2bfloat16(sg / (1.0f + expf(-sg)) * su));
  }
  __syncthreads();
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    const uint16_t* w = w2 + (static_cast<size_t>(e) * H + h) * I;
    float s = 0.0f;
    for (int j = 0; j < I; ++j) s = fmaf(act[j], f(w[j]), s);
    y[static_cast<size_t>(r) * H + h] = s;
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

// One checked operation: its valid rows' inputs and outputs, on the host.
struct Case {
  std::string name;
  std::vector<int> expert;  // per valid row
  std::vector<uint16_t> x, y;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr,
                 "usage: apk_check TOKENS_PREFILL TOKENS_DECODE TOP_K EXPERTS_TOTAL REPEATS COUNTS_OUT PROFILE_OUT "
                 "X_STAR\n");
    return 2;
  }
  std::signal(SIGALRM, on_alarm);
  step("setup", 120);
  const int tokens_p = std::atoi(argv[1]), tokens_d = std::atoi(argv[2]), top_k = std::atoi(argv[3]);
  const int experts_total = std::atoi(argv[4]), repeats = std::max(1, std::atoi(argv[5]));
  const char *counts_out = argv[6], *profile_out = argv[7];
  const double x_star = std::atof(argv[8]);
  const int H = apk::kHidden, I = apk::kInter, E = apk::kLocalExperts;
  std::mt19937_64 rng(20261204);
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
  auto padded = [](const std::vector<uint32_t>& c) {
    uint32_t rows = 0;
    for (uint32_t m : c) rows += (m + apk::kMtPrefill - 1) / apk::kMtPrefill * apk::kMtPrefill;
    return rows;
  };
  // Keeps a prefill count vector inside the contiguous layout's capacity.
  auto fit_prefill = [&](std::vector<uint32_t> c) {
    for (int e = E - 1; e >= 0 && padded(c) > static_cast<uint32_t>(apk::kMaxPrefillRows); --e) c[e] = 0;
    return c;
  };

  // Weights of two layers (operations run on layer 1, so the kernel's layer
  // offsets into weights, maps and scales are exercised) and per-phase buffers.
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
    // The TMA maps as every launcher encodes them (the emitted apk::encode_tensor_maps).
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
  CHECK(cudaDeviceSynchronize());  // the state is zero before the grid starts

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
  step("launch", 60);
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
  // Copy-engine transfers only while the grid runs (a kernel could not start).
  auto h2d = [&](void* dst, const void* src, size_t bytes) {
    CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, host_stream));
    CHECK(cudaStreamSynchronize(host_stream));
  };
  auto d2h = [&](void* dst, const void* src, size_t bytes) {
    CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, host_stream));
    CHECK(cudaStreamSynchronize(host_stream));
  };
  const std::vector<uint16_t> poison(static_cast<size_t>(std::max(ph[0].rows_cap, ph[1].rows_cap)) * H, 0xffffu);
  // Fresh random inputs for the rows an operation uses; every output row poisoned (NaN).
  auto fill = [&](int p, const std::vector<uint32_t>& c) {
    const auto b = row_begin(p, c);
    std::vector<uint16_t> host;
    for (int e = 0; e < E; ++e) {
      host.resize(static_cast<size_t>(c[e]) * H);
      for (auto& v : host) v = to_bits(nd(rng));
      if (!host.empty()) h2d(ph[p].x + static_cast<size_t>(b[e]) * H, host.data(), host.size() * 2);
    }
    h2d(ph[p].y, poison.data(), static_cast<size_t>(ph[p].rows_cap) * H * 2);
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
      d2h(&done, &s->done, 4);
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
        std::fprintf(stderr, "operation %u of phase %d did not finish in 30 s (step %s)\n", seq[p], p, g_step);
        std::exit(3);
      }
    }
    unsigned long long t[3];
    d2h(t, &s->t_instantiated, sizeof(t));
    return Run{(t[2] - t[0]) / 1e3, (t[1] - t[0]) / 1e3, t[0], t[1], t[2]};
  };
  std::vector<Case> cases;
  // Keeps an operation's valid rows (inputs and outputs) for the reference.
  auto keep = [&](const std::string& name, int p, const std::vector<uint32_t>& c) {
    const auto b = row_begin(p, c);
    Case k{name, {}, {}, {}};
    std::vector<uint16_t> rows;
    for (int e = 0; e < E; ++e) {
      if (c[e] == 0) continue;
      const size_t n = static_cast<size_t>(c[e]) * H;
      rows.resize(n);
      d2h(rows.data(), ph[p].x + static_cast<size_t>(b[e]) * H, n * 2);
      k.x.insert(k.x.end(), rows.begin(), rows.end());
      d2h(rows.data(), ph[p].y + static_cast<size_t>(b[e]) * H, n * 2);
      k.y.insert(k.y.end(), rows.begin(), rows.end());
      k.expert.insert(k.expert.end(), c[e], kLayer * E + e);
    }
    cases.push_back(std::move(k));
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
  auto stop_grid = [&] {
    step("stop", 60);
    const uint32_t one = 1;
    h2d(&st->stop, &one, 4);
    const auto t0 = std::chrono::steady_clock::now();
    cudaError_t q;
    while ((q = cudaStreamQuery(kernel_stream)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
        std::fprintf(stderr, "the persistent grid did not stop within 30 s of `stop`\n");
        std::exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(q);
    CHECK(cudaGetLastError());
  };

  const auto cp = fit_prefill(counts_for(tokens_p, apk::kMaxPrefillRows));
  const auto cd = counts_for(tokens_d, apk::kMaxDecodeRows);
  // A decode of footprint x* (whole M_t tiles spread over the local experts, capped by the masked rows).
  std::vector<uint32_t> cx(E, 0);
  {
    const uint32_t tiles = static_cast<uint32_t>(std::max(1.0, std::round(x_star)));
    for (uint32_t t = 0; t < tiles; ++t)
      cx[t % E] = std::min<uint32_t>(cx[t % E] + apk::kMtDecode, apk::kMaxDecodeRows);
  }

#ifdef APK_STATIC_TILES
  {
    step("static prefill", 120);
    fill(apk::kPrefill, cp);
    std::vector<double> us;
    for (int r = 0; r < repeats + 1; ++r) {
      post(apk::kPrefill, cp);
      const double t = wait(apk::kPrefill).inst_to_done_us;
      if (r > 0) us.push_back(t);  // the first run warms up
    }
    stop_grid();
    std::printf("{\"static_prefill_us\": %.1f}\n", median(us));
    return 0;
  }
#endif
  // 1. Numerics: routed counts, edge counts, a contended pair, re-instantiation.
  step("numerics", 120);
  {
    const uint32_t mp = apk::kMtPrefill, md = apk::kMtDecode, cap = apk::kMaxDecodeRows;
    const uint32_t edge_p[] = {0, 1, mp - 1, mp, mp + 1, 2 * mp + 1, 0, 3};
    const uint32_t edge_d[] = {0, 1, std::max(1u, md - 1), std::min(md, cap), std::min(md + 1, cap), cap, 0, 2};
    std::vector<uint32_t> ep(E), ed(E);
    for (int e = 0; e < E; ++e) {
      ep[e] = edge_p[e % 8];
      ed[e] = edge_d[e % 8];
    }
    ep = fit_prefill(ep);
    fill(apk::kPrefill, cp);
    post(apk::kPrefill, cp);
    wait(apk::kPrefill);
    keep("prefill routed", apk::kPrefill, cp);
    fill(apk::kPrefill, ep);
    post(apk::kPrefill, ep);
    wait(apk::kPrefill);
    keep("prefill edge counts", apk::kPrefill, ep);
    fill(apk::kDecode, cd);
    post(apk::kDecode, cd);
    wait(apk::kDecode);
    keep("decode routed", apk::kDecode, cd);
    fill(apk::kDecode, ed);
    post(apk::kDecode, ed);
    wait(apk::kDecode);
    keep("decode edge counts", apk::kDecode, ed);
    fill(apk::kPrefill, cp);
    fill(apk::kDecode, cd);
    post(apk::kPrefill, cp);
    std::this_thread::sleep_for(std::chrono::microseconds(10));
    post(apk::kDecode, cd);
    wait(apk::kDecode);
    wait(apk::kPrefill);
    keep("contended prefill", apk::kPrefill, cp);
    keep("contended decode", apk::kDecode, cd);
    for (int r = 0; r < 3; ++r) {
      fill(apk::kDecode, cd);
      post(apk::kDecode, cd);
      wait(apk::kDecode);
    }
    keep("decode re-instantiated x3", apk::kDecode, cd);
    fill(apk::kDecode, cx);
    post(apk::kDecode, cx);
    wait(apk::kDecode);
    keep("decode at x*", apk::kDecode, cx);
  }

  // 2. Prefill alone and decode alone (medians over repeats).
  step("timing", 240);
  fill(apk::kPrefill, cp);
  fill(apk::kDecode, cd);
  std::vector<double> prefill_alone, decode_alone, decode_shared, prefill_shared, preempt;
  for (int r = 0; r < repeats; ++r) {
    post(apk::kPrefill, cp);
    prefill_alone.push_back(wait(apk::kPrefill).inst_to_done_us);
    post(apk::kDecode, cd);
    decode_alone.push_back(wait(apk::kDecode).inst_to_done_us);
  }
  // 3. Decode posted ~10 µs after a prefill operation.
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
  // 3b. The same with the decode at the plan's expected footprint x*.
  fill(apk::kDecode, cx);
  std::vector<double> xs_alone, xs_shared, xs_prefill;
  for (int r = 0; r < repeats; ++r) {
    post(apk::kDecode, cx);
    xs_alone.push_back(wait(apk::kDecode).inst_to_done_us);
    post(apk::kPrefill, cp);
    std::this_thread::sleep_for(std::chrono::microseconds(10));
    post(apk::kDecode, cx);
    const Run d = wait(apk::kDecode);
    const Run p = wait(apk::kPrefill);
    xs_shared.push_back(d.inst_to_done_us);
    xs_prefill.push_back(p.inst_to_done_us);
  }
  // 4. The measured profile: prefill operations of growing size (x_moe = Σ ⌈m_e / M_t⌉).
  step("profile", 240);
  std::string profile = "{\"samples\": [";
  for (int rows_per_expert : {1, 8, 32, 64, 128, 256, 512, 1024}) {
    std::vector<uint32_t> c(E, static_cast<uint32_t>(rows_per_expert));
    c = fit_prefill(c);
    if (padded(c) == 0) break;
    fill(apk::kPrefill, c);
    std::vector<double> us;
    for (int r = 0; r < 5; ++r) {
      post(apk::kPrefill, c);
      us.push_back(wait(apk::kPrefill).inst_to_done_us);
    }
    uint32_t x = 0;
    for (uint32_t m : c) x += (m + apk::kMtPrefill - 1) / apk::kMtPrefill;
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s{\"component\": \"moe\", \"x\": %u, \"s\": 0, \"t\": %.4e}",
                  profile.back() == '[' ? "" : ", ", x, median(us) * 1e-6);
    profile += buf;
  }
  profile += "]}\n";
  stop_grid();

  // 5. The reference, now that the grid is gone: every kept row.
  step("reference", 240);
  uint16_t *d_r13, *d_r2;  // the bf16 values the kernel multiplies (fp8: dequantized)
  CHECK(cudaMalloc(&d_r13, w13_n * 2));
  CHECK(cudaMalloc(&d_r2, w2_n * 2));
  CHECK(cudaMemcpy(d_r13, w13.data(), w13_n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_r2, w2.data(), w2_n * 2, cudaMemcpyHostToDevice));
  // act is I floats of dynamic shared memory (57 KB for Mixtral): raise the 48 KB default.
  CHECK(cudaFuncSetAttribute(reference_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(I * sizeof(float))));
  std::string errs = "{";
  double worst = 0.0, ref_vs_f64 = 0.0;
  size_t rows_checked = 0;
  bool bad = false;
  for (const Case& k : cases) {
    const size_t n = k.expert.size();
    double num = 0.0, den = 0.0;
    size_t nans = 0;
    if (n > 0) {
      uint16_t* dx;
      int* de;
      float* dy;
      CHECK(cudaMalloc(&dx, n * H * 2));
      CHECK(cudaMalloc(&de, n * 4));
      CHECK(cudaMalloc(&dy, n * H * 4));
      CHECK(cudaMemcpy(dx, k.x.data(), n * H * 2, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(de, k.expert.data(), n * 4, cudaMemcpyHostToDevice));
      reference_rows<<<static_cast<unsigned>(n), 256, I * sizeof(float)>>>(dx, de, d_r13, d_r2, dy, H, I);
      CHECK(cudaGetLastError());
      std::vector<float> ref(n * H);
      CHECK(cudaMemcpy(ref.data(), dy, n * H * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaFree(dx));
      CHECK(cudaFree(de));
      CHECK(cudaFree(dy));
      for (size_t i = 0; i < n * H; ++i) {
        const double got = from_bits(k.y[i]);
        if (std::isnan(got)) ++nans;
        num += (got - ref[i]) * (got - ref[i]);
        den += double(ref[i]) * ref[i];
      }
      // The reference itself against float64 on up to 4 rows of the case.
      for (size_t r = 0; r < n; r += std::max<size_t>(1, n / 4)) {
        const int e = k.expert[r];
        std::vector<double> a(I);
        for (int j = 0; j < I; ++j) {
          double g = 0, u = 0;
          for (int kk = 0; kk < H; ++kk) {
            const double xv = from_bits(k.x[r * H + kk]);
            g += xv * from_bits(w13[(static_cast<size_t>(e) * 2 * I + j) * H + kk]);
            u += xv * from_bits(w13[(static_cast<size_t>(e) * 2 * I + I + j) * H + kk]);
          }
          a[j] = g / (1.0 + std::exp(-g)) * u;
        }
        double rn = 0, rd = 0;
        for (int h = 0; h < H; ++h) {
          double s = 0;
          for (int j = 0; j < I; ++j) s += a[j] * from_bits(w2[(static_cast<size_t>(e) * H + h) * I + j]);
          rn += (ref[r * H + h] - s) * (ref[r * H + h] - s);
          rd += s * s;
        }
        ref_vs_f64 = std::max(ref_vs_f64, std::sqrt(rn / std::max(rd, 1e-300)));
      }
    }
    const double err = nans ? -1.0 : std::sqrt(num / std::max(den, 1e-300));
    bad = bad || nans > 0 || err > 1e-2;
    worst = std::max(worst, err);
    rows_checked += n;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s\"%s\": {\"rows\": %zu, \"rel_err\": %.3e, \"nan\": %zu}",
                  errs.size() > 1 ? ", " : "", k.name.c_str(), n, err, nans);
    errs += buf;
  }
  errs += "}";
  // The reference's own error is part of the verdict (bf16 activations round where f64 does not).
  bad = bad || ref_vs_f64 > 1e-2;

  if (FILE* f = std::fopen(profile_out, "w")) {
    std::fputs(profile.c_str(), f);
    std::fclose(f);
  }
  if (FILE* f = std::fopen(counts_out, "w")) {
    for (int e = 0; e < E; ++e) std::fprintf(f, "%s%u", e ? " " : "", cp[e]);
    std::fputc('\n', f);
    std::fclose(f);
  }

  const double pa = median(prefill_alone), da = median(decode_alone);
  const double ds = median(decode_shared), ps = median(prefill_shared);
  uint32_t mtiles = 0;
  for (uint32_t m : cp) mtiles += (m + apk::kMtPrefill - 1) / apk::kMtPrefill;
  const double tile_us = pa * clusters / std::max<uint32_t>(1, mtiles * (apk::kGateUpGroups + apk::kDownGroups));
  std::printf(
      "{\"gpu\": \"%s\", \"sms\": %d, \"clusters\": %d, \"cluster_size\": %d, \"hidden\": %d, \"inter\": %d, "
      "\"local_experts\": %d, \"fp8\": %s, \"prefill_rows\": %.0f, \"decode_rows\": %.0f, "
      "\"numerics\": %s, \"rows_checked\": %zu, \"worst_rel_err\": %.3e, \"reference_vs_f64\": %.3e, "
      "\"numerics_ok\": %s, "
      "\"prefill_alone_us\": %.1f, \"prefill_tflops\": %.3f, "
      "\"decode_alone_us\": %.1f, \"decode_shared_us\": %.1f, "
      "\"decode_slowdown\": %.3f, \"prefill_shared_us\": %.1f, \"prefill_slowdown\": %.3f, "
      "\"preemption_delay_us\": %.2f, \"mean_tile_us\": %.2f, \"preemption_samples\": %zu, "
      "\"x_star\": %.1f, \"decode_xstar_rows\": %.0f, \"decode_xstar_alone_us\": %.1f, "
      "\"decode_slowdown_xstar\": %.3f, \"prefill_slowdown_xstar\": %.3f}\n",
      prop.name, prop.multiProcessorCount, clusters, apk::kClusterSize, H, I, E, apk::kFp8Weights ? "true" : "false",
      flops(cp) / (2.0 * H * 2 * I + 2.0 * I * H), flops(cd) / (2.0 * H * 2 * I + 2.0 * I * H), errs.c_str(),
      rows_checked, worst, ref_vs_f64, bad ? "false" : "true", pa, flops(cp) / (pa * 1e-6) / 1e12, da, ds, ds / da, ps,
      ps / pa, median(preempt), tile_us, preempt.size(), x_star, flops(cx) / (2.0 * H * 2 * I + 2.0 * I * H),
      median(xs_alone), median(xs_shared) / median(xs_alone), median(xs_prefill) / pa);
  return bad ? 1 : 0;
}
