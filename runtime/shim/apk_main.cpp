// Drives an emitted APK on the host (runtime/shim/apk_host.h): CTA clusters as
// threads, an "attention side" posting a seeded random mix of prefill and
// decode operations, then checks from the trace:
//   - every tile of every operation ran exactly once;
//   - each Down tile started after every GateUp tile of its rows ended;
//   - outputs equal a scalar reference (bit for bit: same sums, same order);
//   - after decode's assignment is written, a decode-assigned cluster claims
//     at most one more prefill tile (the one its boundary decision raced
//     with) while decode still has unclaimed tiles;
//   - clusters take the other phase's tiles when their own has none;
//   - no deadlock (a watchdog aborts).
// Usage: apk SEED CLUSTERS OPS COMPUTE(0|1) MAX_ROWS [WIDEN_US]
#define APK_HOST_EMULATION 1
#include KERNEL_SOURCE

#include <algorithm>
#include <chrono>
#include <map>
#include <random>

namespace {

using apk_host::Ev;
using apk_host::Event;

struct Op {
  uint32_t phase, seq, layer;
  std::vector<uint32_t> counts;
  uint64_t posted_at = 0, done_at = 0;
};

uint16_t bf16_bits(float f) { return shim_float_to_bf16(f).bits; }
float bf(uint16_t b) { return shim_bf16_to_float(__nv_bfloat16{b}); }

// First row of local expert e: prefill's contiguous layout pads each expert
// to M_t rows; decode's masked layout gives each expert kMaxDecodeRows.
uint32_t row_begin(int ph, const std::vector<uint32_t>& counts, int e) {
  if (ph != apk::kPrefill) return static_cast<uint32_t>(e) * apk::kMaxDecodeRows;
  uint32_t begin = 0;
  for (int f = 0; f < e; ++f) begin += (counts[f] + apk::kMtPrefill - 1) / apk::kMtPrefill * apk::kMtPrefill;
  return begin;
}

int fail_check(const char* what) {
  std::fprintf(stderr, "FAILED: %s\n", what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) return fail_check("usage: apk SEED CLUSTERS OPS COMPUTE MAX_ROWS [WIDEN_US]");
  apk_host::widen_us = argc == 7 ? static_cast<unsigned>(std::atoi(argv[6])) : 0;
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const uint32_t clusters = static_cast<uint32_t>(std::atoi(argv[2]));
  const int n_ops = std::atoi(argv[3]);
  const bool compute = std::atoi(argv[4]) != 0;
  const uint32_t max_rows = static_cast<uint32_t>(std::atoi(argv[5]));
  if (clusters == 0 || clusters > static_cast<uint32_t>(apk::kMaxClusters)) return fail_check("bad cluster count");
  std::mt19937_64 rng(seed);
  apk_host::compute = compute;
  constexpr int L = 2;
  const int H = apk::kHidden, I = apk::kInter, E = apk::kLocalExperts;

  // Buffers (only when computing): weights, and per phase x / act / y.
  // Weights: bf16 bits, or fp8 e4m3 bytes with one scale per 128×128 block.
  std::vector<uint16_t> w13, w2;
  std::vector<uint8_t> q13, q2;
  std::vector<float> s13, s2;
  uint32_t rows_cap[2] = {0, 0};
  std::vector<uint16_t> x[2], act[2], y[2];
  auto rnd = [&] { return std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng); };
  if (compute) {
    w13.resize(static_cast<size_t>(L) * E * 2 * I * H);
    w2.resize(static_cast<size_t>(L) * E * H * I);
    for (auto& v : w13) v = bf16_bits(rnd() * 0.2f);
    for (auto& v : w2) v = bf16_bits(rnd() * 0.2f);
    if (apk::kFp8Weights) {
      // Any e4m3 byte but the NaNs (S.1111.111), and positive scales.
      auto byte = [&] {
        uint8_t b;
        do b = static_cast<uint8_t>(rng()); while ((b & 0x7f) == 0x7f);
        return b;
      };
      q13.resize(w13.size());
      q2.resize(w2.size());
      for (auto& v : q13) v = byte();
      for (auto& v : q2) v = byte();
      auto blocks = [](int r, int c) { return static_cast<size_t>((r + 127) / 128) * ((c + 127) / 128); };
      s13.resize(static_cast<size_t>(L) * E * blocks(2 * I, H));
      s2.resize(static_cast<size_t>(L) * E * blocks(H, I));
      for (auto& v : s13) v = 0.002f + 0.004f * (rnd() + 0.5f);
      for (auto& v : s2) v = 0.002f + 0.004f * (rnd() + 0.5f);
    }
    // Prefill: contiguous rows, each expert padded to M_t; decode: masked.
    rows_cap[apk::kPrefill] = static_cast<uint32_t>(E) * ((max_rows + apk::kMtPrefill - 1) / apk::kMtPrefill) * apk::kMtPrefill;
    rows_cap[apk::kDecode] = static_cast<uint32_t>(E) * apk::kMaxDecodeRows;
    for (int ph = 0; ph < 2; ++ph) {
      x[ph].assign(static_cast<size_t>(rows_cap[ph]) * H, 0);
      act[ph].assign(static_cast<size_t>(rows_cap[ph]) * I, 0);
      y[ph].assign(static_cast<size_t>(rows_cap[ph]) * H, 0);
    }
  }
  apk::Templates tm{};
  for (int ph = 0; ph < 2; ++ph) {
    tm.phase[ph].x = compute ? reinterpret_cast<const __nv_bfloat16*>(x[ph].data()) : nullptr;
    tm.phase[ph].act = compute ? reinterpret_cast<__nv_bfloat16*>(act[ph].data()) : nullptr;
    tm.phase[ph].y = compute ? reinterpret_cast<__nv_bfloat16*>(y[ph].data()) : nullptr;
  }
  if (apk::kFp8Weights) {
    tm.w13 = compute ? reinterpret_cast<const apk::Weight*>(q13.data()) : nullptr;
    tm.w2 = compute ? reinterpret_cast<const apk::Weight*>(q2.data()) : nullptr;
    tm.w13_scale = compute ? s13.data() : nullptr;
    tm.w2_scale = compute ? s2.data() : nullptr;
  } else {
    tm.w13 = compute ? reinterpret_cast<const apk::Weight*>(w13.data()) : nullptr;
    tm.w2 = compute ? reinterpret_cast<const apk::Weight*>(w2.data()) : nullptr;
  }
  auto state = std::make_unique<apk::State>();
  std::memset(state.get(), 0, sizeof(apk::State));
  apk::State* st = state.get();

  // Clusters and CTA threads: a producer and kUnits math units per CTA.
  const uint32_t ctas = clusters * apk::kClusterSize;
  std::vector<apk_host::Cluster> cl(clusters);
  std::vector<std::unique_ptr<apk::Smem>> smem;
  for (uint32_t b = 0; b < ctas; ++b) {
    smem.push_back(std::make_unique<apk::Smem>());
    apk::init_signals(*smem.back());
    cl[b / apk::kClusterSize].smem.push_back(smem.back().get());
  }
  constexpr int kRoles = 1 + apk::kUnits + (apk::kFp8Weights ? 1 : 0);
  std::vector<std::vector<Event>> logs(ctas * kRoles + 1);
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 1200 && !finished.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished.load()) {
      std::fprintf(stderr, "FAILED: not finished in 120 s (deadlock?)\n");
      std::_Exit(3);
    }
  });
  std::vector<std::thread> threads;
  for (uint32_t b = 0; b < ctas; ++b) {
    // Roles: the producer, the math units, and (fp8 weights) the transform warps.
    for (int role = 0; role < kRoles; ++role) {
      threads.emplace_back([&, b, role] {
        apk_host::log = &logs[b * kRoles + static_cast<uint32_t>(role)];
        apk_host::cta = b;
        apk_host::rank = b % apk::kClusterSize;
        apk_host::cluster = &cl[b / apk::kClusterSize];
        apk_host::smem = smem[b].get();
        if (role == apk::kUnits + 1)
          apk::transform(tm, st, *smem[b], apk_host::rank, 0);
        else if (role == 0)
          apk::producer(tm, st, *smem[b], b / apk::kClusterSize, clusters, apk_host::rank, 0);
        else
          apk::consumer(tm, st, *smem[b], apk_host::rank, static_cast<uint32_t>(role - 1), 0);
      });
    }
  }

  // The attention side.
  apk_host::log = &logs.back();
  apk_host::cta = ctas;
  std::vector<Op> ops;
  uint32_t seq[2] = {0, 0};
  std::vector<int> last(2, -1);
  int max_err_ops = 0;
  double max_err = 0.0;
  auto wait_done = [&](int ph) {
    if (last[ph] < 0) return;
    Op& op = ops[static_cast<size_t>(last[ph])];
    while (apk::ld_acquire_sys(&st->phase[ph].done) != op.seq) std::this_thread::yield();
    op.done_at = apk_host::clock.load(std::memory_order_relaxed);
    if (!compute) return;
    // Reference: the same fp32 sums in the same order, rounded where the kernel rounds.
    const apk::Shape sh = apk::shape_of(st->phase[ph]);
    for (int e = 0; e < E; ++e) {
      const uint32_t begin = row_begin(ph, op.counts, e);
      // Weights as the tensor cores see them (bf16, or fp8 × block scale rounded to bf16).
      const size_t mat = static_cast<size_t>(op.layer) * E + static_cast<size_t>(e);
      for (uint32_t r = begin; r < begin + op.counts[e]; ++r) {
        std::vector<uint16_t> a(I);
        for (int j = 0; j < I; ++j) {
          float g = 0.0f, u = 0.0f;
          for (int k = 0; k < H; ++k) {
            const float xv = bf(x[ph][static_cast<size_t>(r) * H + k]);
            g += xv * apk::weight_at(tm, sh, false, mat, j, k);
            u += xv * apk::weight_at(tm, sh, false, mat, I + j, k);
          }
          a[j] = bf16_bits(g / (1.0f + std::exp(-g)) * u);
        }
        for (int h = 0; h < H; ++h) {
          float acc = 0.0f;
          for (int k = 0; k < I; ++k) acc += bf(a[k]) * apk::weight_at(tm, sh, true, mat, h, k);
          const double err = std::fabs(static_cast<double>(bf(bf16_bits(acc))) - bf(y[ph][static_cast<size_t>(r) * H + h]));
          if (err > 0.0) ++max_err_ops;
          max_err = std::max(max_err, err);
        }
      }
    }
  };
  for (int i = 0; i < n_ops; ++i) {
    const uint32_t ph = static_cast<uint32_t>(rng() % 3 == 0 ? apk::kPrefill : apk::kDecode);
    wait_done(static_cast<int>(ph));
    Op op;
    op.phase = ph;
    op.seq = ++seq[ph];
    op.layer = static_cast<uint32_t>(rng() % L);
    op.counts.resize(E);
    const uint32_t cap = ph == apk::kDecode ? std::min<uint32_t>(max_rows, apk::kMaxDecodeRows) : max_rows;
    for (auto& c : op.counts) c = static_cast<uint32_t>(rng() % (cap + 1));
    if (rng() % 4 == 0) op.counts[rng() % E] = 0;
    if (compute) {
      for (int e = 0; e < E; ++e) {
        const uint32_t begin = row_begin(static_cast<int>(ph), op.counts, e);
        for (size_t k = static_cast<size_t>(begin) * H; k < static_cast<size_t>(begin + op.counts[e]) * H; ++k)
          x[ph][k] = bf16_bits(rnd());
      }
    }
    st->phase[ph].layer = op.layer;
    for (int e = 0; e < E; ++e) st->phase[ph].counts[e] = op.counts[e];
    op.posted_at = apk_host::clock.fetch_add(1, std::memory_order_relaxed);
    APK_TRACE(post, ph, op.seq, 0);
    apk::st_release_sys(&st->phase[ph].posted, op.seq);
    last[ph] = static_cast<int>(ops.size());
    ops.push_back(op);
    // Sometimes let the operation run alone, sometimes overlap the next.
    if (rng() % 4 == 0) wait_done(static_cast<int>(ph));
  }
  wait_done(apk::kPrefill);
  wait_done(apk::kDecode);
  apk::st_release_sys(&st->stop, 1);
  for (auto& t : threads) t.join();
  finished = true;
  watchdog.join();

  // ───────────── checks over the merged trace ─────────────
  std::vector<Event> ev;
  for (auto& l : logs) ev.insert(ev.end(), l.begin(), l.end());
  std::sort(ev.begin(), ev.end(), [](const Event& a, const Event& b) { return a.time < b.time; });
  // (phase, seq) → total tiles; (phase, seq, tile) → start/end times.
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> totals;
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<uint64_t>> starts, ends;
  for (const Event& e : ev)
    if (e.kind == Ev::instantiate) totals[{e.a, e.b}] = e.c;
  // Start/end events carry (cluster, phase, tile); the op is the one whose
  // instantiation precedes the event in that phase.
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint32_t>>> inst;  // phase → (time, seq)
  for (const Event& e : ev)
    if (e.kind == Ev::instantiate) inst[e.a].push_back({e.time, e.b});
  auto op_at = [&](uint32_t ph, uint64_t t) -> uint32_t {
    uint32_t s = 0;
    for (auto& [time, q] : inst[ph])
      if (time < t) s = q;
    return s;
  };
  uint64_t tiles_run = 0;
  for (const Event& e : ev) {
    if (e.kind != Ev::start && e.kind != Ev::end) continue;
    const uint32_t s = op_at(e.b, e.time);
    auto key = std::make_tuple(e.b, s, e.c);
    if (e.kind == Ev::start) {
      starts[key].push_back(e.time);
      ++tiles_run;
    } else {
      ends[key].push_back(e.time);
    }
  }
  for (auto& [k, total] : totals) {
    for (uint32_t t = 0; t < total; ++t) {
      auto key = std::make_tuple(k.first, k.second, t);
      if (starts[key].size() != 1 || ends[key].size() != 1) {
        std::fprintf(stderr, "phase %u op %u tile %u ran %zu times\n", k.first, k.second, t, starts[key].size());
        return fail_check("every tile exactly once");
      }
    }
  }
  for (const auto& [key, v] : starts)
    if (std::get<2>(key) >= totals[{std::get<0>(key), std::get<1>(key)}]) return fail_check("tile index beyond the operation");
  // GateUp → Down per m-tile.
  for (const Op& op : ops) {
    const int mt_rows = op.phase == apk::kPrefill ? apk::kMtPrefill : apk::kMtDecode;
    uint32_t mtiles = 0;
    for (uint32_t c : op.counts) mtiles += (c + mt_rows - 1) / mt_rows;
    const uint32_t gu = mtiles * apk::kGateUpGroups;
    for (uint32_t m = 0; m < mtiles; ++m) {
      uint64_t last_gu_end = 0;
      for (uint32_t g = 0; g < static_cast<uint32_t>(apk::kGateUpGroups); ++g)
        last_gu_end = std::max(last_gu_end, ends[{op.phase, op.seq, m * apk::kGateUpGroups + g}].at(0));
      for (uint32_t g = 0; g < static_cast<uint32_t>(apk::kDownGroups); ++g)
        if (starts[{op.phase, op.seq, gu + m * apk::kDownGroups + g}].at(0) < last_gu_end)
          return fail_check("a Down tile started before its rows' GateUp tiles ended");
    }
  }
  // Preemption bound: after each decode assignment, decode-assigned clusters.
  uint32_t worst_after_signal = 0, signals = 0;
  for (size_t i = 0; i < ev.size(); ++i) {
    const Event& a = ev[i];
    if (a.kind != Ev::assign || a.a >= a.b) continue;  // only contended assignments (decode < all)
    // Decode has unclaimed tiles until its last claim.
    uint64_t last_decode_claim = 0;
    for (size_t j = i + 1; j < ev.size(); ++j) {
      if (ev[j].kind == Ev::instantiate && ev[j].a == apk::kDecode) break;
      if (ev[j].kind == Ev::claim && ev[j].b == apk::kDecode) last_decode_claim = ev[j].time;
    }
    ++signals;
    for (uint32_t c = 0; c < a.a; ++c) {
      uint32_t prefill_after = 0;
      for (size_t j = i + 1; j < ev.size() && ev[j].time < last_decode_claim; ++j) {
        const Event& e = ev[j];
        if (e.kind != Ev::claim || e.a != c) continue;
        if (e.b == apk::kDecode) break;
        ++prefill_after;
      }
      worst_after_signal = std::max(worst_after_signal, prefill_after);
    }
  }
  if (worst_after_signal > 1) return fail_check("a decode-assigned cluster claimed more than one prefill tile after the signal");
  // Idle clusters go where the work is: tiles run by a cluster whose last
  // read assignment named the other phase.
  std::vector<uint32_t> assigned(clusters, 0);
  uint64_t borrowed = 0;
  for (const Event& e : ev) {
    if (e.kind == Ev::read_assign) assigned[e.a] = e.b;
    if (e.kind == Ev::start && e.b != assigned[e.a]) ++borrowed;
  }
  if (borrowed == 0) return fail_check("no cluster ever took the other phase's tiles");
  if (compute && max_err > 0.0) {
    std::fprintf(stderr, "%d outputs differ, max |error| %g\n", max_err_ops, max_err);
    return fail_check("outputs equal the reference");
  }
  std::printf("ops=%zu tiles=%llu contended_signals=%u max_prefill_tiles_after_signal=%u borrowed_tiles=%llu compute=%d\n",
              ops.size(), static_cast<unsigned long long>(tiles_run), signals, worst_after_signal,
              static_cast<unsigned long long>(borrowed), compute ? 1 : 0);
  return 0;
}
