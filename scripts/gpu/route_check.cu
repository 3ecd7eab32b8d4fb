// GPU check of the replica routing (Zepp §5: "routing uses CUDA kernels and
// greedy waterfilling ...; routing, swap planning, and associated metadata
// exchange and construction account for approximately 5% of iteration
// latency"). The bundle's kernels/zepp_route.cu, included as KERNEL_SOURCE,
// runs on a case `cargo bench --bench routing` writes with
// MOEFORGE_ROUTING_CASES (DeepSeek-V3 on 4 x 8 GPUs, Zepp with 32 redundant
// replicas, a decode or a prefill volume per GPU):
//   - every source's routing on this GPU (each GPU routes all sources and
//     keeps its own entries, as the dispatch does), every entry's physical
//     slot compared with the host routing's (route_local, row_queues);
//   - the time each GPU spends per MoE layer: REPEATS back-to-back pairs of
//     zepp_count then zepp_route for a source, queued behind one event pair
//     (so host launch gaps hide behind GPU work), divided by REPEATS; the
//     slowest source (the dispatch waits for it) beside the modeled MoE
//     layer. Not included: the counts exchange between GPUs (world x
//     experts int32) and the rest of an iteration (the budget's base is the
//     whole iteration; this compares with one MoE layer, the stricter).
//     The first mismatching entry is named.
// Prints one JSON object; exits 1 on a mismatch.
// Usage: route_check CASE_FILE REPEATS
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include KERNEL_SOURCE

#include "cuda_check.h"

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: route_check CASE_FILE REPEATS\n");
    return 2;
  }
  std::ifstream f(argv[1]);
  std::string name;
  if (!f || !std::getline(f, name)) {
    std::fprintf(stderr, "cannot read %s\n", argv[1]);
    return 2;
  }
  long long world = 0, gpn = 0, experts = 0, reps = 0, slots = 0, modeled_ns = 0;
  f >> world >> gpn >> experts >> reps >> slots >> modeled_ns;
  if (!f || world <= 0 || gpn <= 0 || world % gpn || experts <= 0 || reps <= 0 || slots <= 0 || modeled_ns <= 0) {
    std::fprintf(stderr, "%s: bad header\n", argv[1]);
    return 2;
  }
  // The case was routed by Zepp's routing at the placement's 10% slack.
  if (!kZepp || kSlack != 0.1) {
    std::fprintf(stderr, "the kernel is not Zepp's routing at slack 0.1 (kZepp %d, kSlack %g)\n", int(kZepp), kSlack);
    return 2;
  }
  std::vector<int32_t> table(experts * reps);
  for (auto& x : table) f >> x;
  std::vector<std::vector<int32_t>> ids(world), want(world);
  for (long long s = 0; s < world; ++s) {
    long long n = 0;
    f >> n;
    ids[s].resize(n);
    want[s].resize(n);
    for (auto& x : ids[s]) f >> x;
    for (auto& x : want[s]) f >> x;
  }
  std::string extra;
  if (!f || (f >> extra)) {
    std::fprintf(stderr, "%s: %s\n", argv[1], f ? "data past the last source" : "truncated");
    return 2;
  }
  const int repeats = std::max(1, std::atoi(argv[2]));
  size_t most = 1, total = 0;
  for (auto& v : ids) {
    most = std::max(most, v.size());
    total += v.size();
  }
  // ZeppRouteParts's work words (plan/src/memory.rs), with room to spare.
  const long long e = experts, w = world, r = reps;
  const long long work_words = 2 * (e + e * r + e + 3 * e * w + 2 * e * w * r + 2 * e * r + 3 * e * r + e + 2 * w + 2);
  int32_t *d_ids, *d_demand, *d_table, *d_member, *d_work, *d_dest;
  CHECK(cudaMalloc(&d_ids, sizeof(int32_t) * world * most));
  CHECK(cudaMalloc(&d_demand, sizeof(int32_t) * world * experts));
  CHECK(cudaMalloc(&d_table, sizeof(int32_t) * table.size()));
  CHECK(cudaMalloc(&d_member, sizeof(int32_t) * world));
  CHECK(cudaMalloc(&d_work, sizeof(int32_t) * work_words));
  CHECK(cudaMalloc(&d_dest, sizeof(int32_t) * most));
  std::vector<int32_t> member(world, 1);
  CHECK(cudaMemcpy(d_table, table.data(), sizeof(int32_t) * table.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_member, member.data(), sizeof(int32_t) * world, cudaMemcpyHostToDevice));
  for (long long s = 0; s < world; ++s) {
    CHECK(cudaMemcpy(d_ids + s * most, ids[s].data(), sizeof(int32_t) * ids[s].size(), cudaMemcpyHostToDevice));
  }
  const unsigned count_blocks = unsigned((experts + kThreads - 1) / kThreads);
  auto count = [&](long long s) {
    zepp_count<<<count_blocks, kThreads>>>(d_ids + s * most, int(ids[s].size()), int(experts), d_demand + s * experts,
                                            nullptr, nullptr, 1);
  };
  auto route = [&](long long s) {
    zepp_route<<<1, kThreads>>>(d_ids + s * most, int(ids[s].size()), d_demand, d_table, d_member, int(experts),
                                int(reps), int(world), int(gpn), int(slots), int(s), d_work, d_dest);
  };
  // Correctness: every source's demand row, then every source's routing.
  for (long long s = 0; s < world; ++s) count(s);
  CHECK(cudaGetLastError());
  long long mismatches = 0, bad_source = -1, bad_entry = -1, bad_got = 0, bad_want = 0;
  std::vector<int32_t> got(most);
  for (long long s = 0; s < world; ++s) {
    route(s);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(got.data(), d_dest, sizeof(int32_t) * ids[s].size(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < ids[s].size(); ++i) {
      if (got[i] == want[s][i]) continue;
      if (bad_source < 0) {
        bad_source = s;
        bad_entry = (long long)i;
        bad_got = got[i];
        bad_want = want[s][i];
      }
      ++mismatches;
    }
  }
  // Time: per source, REPEATS back-to-back (count, route) pairs between two
  // events, after a warm-up pair (the demand rows stay in place).
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> per_source;
  for (long long s = 0; s < world; ++s) {
    count(s);
    route(s);
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < repeats; ++i) {
      count(s);
      route(s);
    }
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    per_source.push_back(ms * 1e3 / repeats);
  }
  CHECK(cudaGetLastError());
  const double slowest = *std::max_element(per_source.begin(), per_source.end());
  const double modeled_us = modeled_ns / 1e3;
  std::printf(
      "{\"case\": \"%s\", \"sources\": %lld, \"experts\": %lld, \"replicas\": %lld, \"entries\": %zu, "
      "\"mismatches\": %lld, \"first_bad\": {\"source\": %lld, \"entry\": %lld, \"got\": %lld, \"want\": %lld}, "
      "\"routing_us\": %.2f, \"routing_us_median_source\": %.2f, \"modeled_layer_us\": %.1f, "
      "\"routing_over_layer\": %.4f, \"repeats\": %d}\n",
      name.c_str(), world, experts, reps, total, mismatches, bad_source, bad_entry, bad_got, bad_want, slowest,
      median(per_source), modeled_us, slowest / modeled_us, repeats);
  return mismatches ? 1 : 0;
}
