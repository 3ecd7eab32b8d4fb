// Drives an emitted APK on the host the way a MoE server runs it: the
// persistent grid resident while an "attention side" posts a seeded random
// mix of prefill and decode operations, then checks from the trace:
//   - every tile of every operation ran exactly once;
//   - each Down tile started after every GateUp tile of its rows ended;
//   - after decode's assignment is written, a decode-assigned cluster claims
//     at most one more prefill tile (the one its boundary decision raced
//     with) while decode still has unclaimed tiles;
//   - clusters take the other phase's tiles when their own has none;
//   - no deadlock (the shim's watchdog aborts);
// and, built with the PTX layer's emulation (every CUDA thread a fiber, the
// tensor-core path computing), every output row against a reference written
// here (SiLU(x·W1ᵀ)·(x·W3ᵀ), then ·W2ᵀ, the weights as the tensor cores see
// them). Built with APK_PROTOCOL_TIER, each CTA role is an OS thread, tiles
// only signal, and ThreadSanitizer checks the orderings.
// Usage: apk SEED CLUSTERS OPS MAX_ROWS [WIDEN_US]
#include KERNEL_SOURCE
#ifndef APK_PROTOCOL_TIER
#include "apk_driver.h"
#endif

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

// A weight as the tensor cores see it: bf16, or fp8 e4m3 times its
// 128×128 block scale, rounded to bf16 (the transform warps' output).
float e4m3(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man) / 8.0f, -6);
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) return fail_check("usage: apk SEED CLUSTERS OPS MAX_ROWS [WIDEN_US]");
  apk_host::widen_us = argc == 6 ? static_cast<unsigned>(std::atoi(argv[5])) : 0;
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const uint32_t clusters = static_cast<uint32_t>(std::atoi(argv[2]));
  const int n_ops = std::atoi(argv[3]);
  const uint32_t max_rows = static_cast<uint32_t>(std::atoi(argv[4]));
#ifdef APK_PROTOCOL_TIER
  constexpr bool compute = false;
#else
  constexpr bool compute = true;
#endif
  if (clusters == 0 || clusters > static_cast<uint32_t>(apk::kMaxClusters)) return fail_check("bad cluster count");
  std::mt19937_64 rng(seed);
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
  auto blocks = [](int r, int c) { return static_cast<size_t>((r + 127) / 128) * ((c + 127) / 128); };
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
  // The weights as the tensor cores see them, per matrix (w13: 2·I rows of H; w2: H rows of I).
  std::vector<float> wf13(w13.size()), wf2(w2.size());
  auto dequantize = [&](bool down) {
    const int rows = down ? H : 2 * I, cols = down ? I : H;
    std::vector<float>& out = down ? wf2 : wf13;
    for (size_t at = 0; at < out.size(); ++at) {
      if (!apk::kFp8Weights) {
        out[at] = bf((down ? w2 : w13)[at]);
        continue;
      }
      const size_t mat = at / (static_cast<size_t>(rows) * cols), row = at / cols % rows, k = at % cols;
      const size_t scale_cols = (static_cast<size_t>(cols) + 127) / 128;
      const float sc = (down ? s2 : s13)[mat * blocks(rows, cols) + row / 128 * scale_cols + k / 128];
      out[at] = bf(bf16_bits(e4m3((down ? q2 : q13)[at]) * sc));
    }
  };
  dequantize(false);
  dequantize(true);
  auto weight_at = [&](bool down, size_t mat, int row, int k) -> float {
    const int rows = down ? H : 2 * I, cols = down ? I : H;
    return (down ? wf2 : wf13)[(mat * rows + static_cast<size_t>(row)) * cols + static_cast<size_t>(k)];
  };
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
  std::memset(static_cast<void*>(state.get()), 0, sizeof(apk::State));
  apk::State* st = state.get();

  // The attention side.
  std::vector<Op> ops;
  uint32_t seq[2] = {0, 0};
  std::vector<int> last(2, -1);
  int max_err_ops = 0;
  double max_err = 0.0;
  uint64_t checked = 0;
  auto wait_done = [&](int ph) {
    if (last[ph] < 0) return;
    Op& op = ops[static_cast<size_t>(last[ph])];
    while (ptx::ld_acquire_sys_u32(&st->phase[ph].done) != op.seq) shim::yield();
    op.done_at = apk_host::clock.load(std::memory_order_relaxed);
    if (!compute) return;
    // The reference: f32 sums (the kernel's run in another order), the
    // activation rounded to bf16 where the kernel rounds it; an output may
    // differ by the bf16 roundings that order moves (2^-7 of the output
    // and 2^-8 of the sum of |terms|), a layout error by far more.
    for (int e = 0; e < E; ++e) {
      const uint32_t begin = row_begin(ph, op.counts, e);
      const size_t mat = static_cast<size_t>(op.layer) * E + static_cast<size_t>(e);
      for (uint32_t r = begin; r < begin + op.counts[e]; ++r) {
        std::vector<float> a(I);
        for (int j = 0; j < I; ++j) {
          float g = 0.0f, u = 0.0f;
          for (int k = 0; k < H; ++k) {
            const float xv = bf(x[ph][static_cast<size_t>(r) * H + k]);
            g += xv * weight_at(false, mat, j, k);
            u += xv * weight_at(false, mat, I + j, k);
          }
          a[j] = bf(bf16_bits(g / (1.0f + std::exp(-g)) * u));
        }
        for (int h = 0; h < H; ++h) {
          float acc = 0.0f, mag = 0.0f;
          for (int k = 0; k < I; ++k) {
            const float t = a[k] * weight_at(true, mat, h, k);
            acc += t;
            mag += std::fabs(t);
          }
          const double got = bf(y[ph][static_cast<size_t>(r) * H + h]);
          const double err = std::fabs(got - acc);
          const double tol = std::ldexp(std::fabs(acc), -7) + std::ldexp(mag, -8) + 1e-6;
          if (err > tol) ++max_err_ops;
          max_err = std::max(max_err, err / (tol + 1e-30));
          ++checked;
        }
      }
    }
  };
  auto attention = [&] {
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
      ptx::st_release_sys_u32(&st->phase[ph].posted, op.seq);
      last[ph] = static_cast<int>(ops.size());
      ops.push_back(op);
      // Sometimes let the operation run alone, sometimes overlap the next.
      if (rng() % 4 == 0) wait_done(static_cast<int>(ph));
    }
    wait_done(apk::kPrefill);
    wait_done(apk::kDecode);
    ptx::st_release_sys_u32(&st->stop, 1);
  };

#ifdef APK_PROTOCOL_TIER
  const uint32_t ctas = clusters * apk::kClusterSize;
  // Clusters and CTA roles as OS threads: a producer, kUnits math units and
  // (fp8 weights) the transform warps per CTA, each standing for its warp or
  // warpgroup in the CTA's shared window.
  std::vector<std::unique_ptr<apk::Smem>> smem;
  std::vector<shim::Cta> cta(ctas);
  std::vector<shim::Cta*> peers(ctas);
  for (uint32_t b = 0; b < ctas; ++b) {
    smem.push_back(std::make_unique<apk::Smem>());
    cta[b] = shim::Cta{reinterpret_cast<unsigned char*>(smem.back().get()), sizeof(apk::Smem),
                       b % static_cast<uint32_t>(apk::kClusterSize), static_cast<uint32_t>(apk::kClusterSize),
                       &peers[b / apk::kClusterSize * apk::kClusterSize]};
    peers[b] = &cta[b];
  }
  for (uint32_t b = 0; b < ctas; ++b) {
    shim::outside_cta = &cta[b];
    apk::init_signals(*smem[b]);
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
    for (int role = 0; role < kRoles; ++role) {
      threads.emplace_back([&, b, role] {
        apk_host::log = &logs[b * kRoles + static_cast<uint32_t>(role)];
        shim::outside_cta = &cta[b];
        const uint32_t rank = b % apk::kClusterSize;
        if (role == apk::kUnits + 1)
          apk::transform(tm, st, *smem[b], rank, 0);
        else if (role == 0)
          apk::producer(tm, st, *smem[b], b / apk::kClusterSize, clusters, rank, 0);
        else
          apk::consumer(tm, st, *smem[b], rank, static_cast<uint32_t>(role - 1), 0);
      });
    }
  }
  apk_host::log = &logs.back();
  attention();
  for (auto& t : threads) t.join();
  finished = true;
  watchdog.join();
#else
  // The resident grid with every CUDA thread a fiber, the attention side a
  // host fiber beside it.
  for (uint32_t ph = 0; ph < 2; ++ph) {
    const apk::MapShape maps{rows_cap[ph], static_cast<uint32_t>(H), static_cast<uint32_t>(H),
                             static_cast<uint32_t>(I), static_cast<uint32_t>(H), static_cast<uint32_t>(H),
                             static_cast<uint32_t>(I), static_cast<uint32_t>(L * E)};
    if (!apk_driver::maps(tm, ph, maps)) return fail_check("a tensor map was refused");
  }
  std::vector<std::vector<Event>> logs(1);
  apk_driver::run(tm, st, clusters, logs[0], {attention});
#endif

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
  if (compute && max_err_ops > 0) {
    std::fprintf(stderr, "%d of %llu outputs past the tolerance, worst %.3g× it\n", max_err_ops,
                 static_cast<unsigned long long>(checked), max_err);
    return fail_check("outputs equal the reference");
  }
  std::printf(
      "ops=%zu tiles=%llu contended_signals=%u max_prefill_tiles_after_signal=%u borrowed_tiles=%llu compute=%d "
      "checked=%llu worst_err_of_tol_pct=%.0f\n",
      ops.size(), static_cast<unsigned long long>(tiles_run), signals, worst_after_signal,
      static_cast<unsigned long long>(borrowed), compute ? 1 : 0, static_cast<unsigned long long>(checked),
      max_err * 100.0);
  return 0;
}
