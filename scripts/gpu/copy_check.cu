// GPU check of the weight reshard's transfers (Moebius §4.3): one MoE layer's
// descriptors from a bundle's plan.json (scripts/gpu-check.sh extracts them),
// each rank's source expert slot and destination slot side by side in its
// own region of one GPU's memory (rank r: bytes [2r·SLOT, 2r·SLOT + 2·SLOT),
// source at 0, destination at SLOT), executed three ways and timed against a
// plain device-to-device copy of the same bytes:
//   kernel:   one launch of the bundle's transfer program
//             (kernels/xfer_reshard.ptx, the PTX LLVM emitted from the
//             program's IR, loaded through the driver's JIT as the cuda
//             backend loads it) over this layer's batch;
//   memcpy2d: one cudaMemcpy2DAsync per descriptor row (the copy engines);
//   d2d:      cudaMemcpyAsync of the total bytes (the ceiling).
// Each way's result is compared byte for byte with a host execution of the
// descriptors. Prints one JSON object.
// Usage: copy_check DESCRIPTORS_FILE PTX_FILE TABLE_FILE REPEATS
//   descriptors: "RANKS SLOT_BYTES" then one line per descriptor:
//     src_rank dst_rank src_off dst_off run c0 c1 ss0 ss1 ds0 ds1
//   table: the batch's words (moeforge_xfer::Batch::words) for this layout
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.h"

#include <fstream>
#include <sstream>
#include <string>

struct MoeforgeCopy {
  unsigned long long src, dst, run, c0, c1, ss0, ss1, ds0, ds1;
};

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: copy_check DESCRIPTORS_FILE PTX_FILE TABLE_FILE REPEATS\n");
    return 2;
  }
  FILE* f = std::fopen(argv[1], "r");
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  const int repeats = std::max(1, std::atoi(argv[4]));
  unsigned long long ranks = 0, slot = 0;
  if (std::fscanf(f, "%llu %llu", &ranks, &slot) != 2 || ranks == 0 || slot == 0) {
    std::fprintf(stderr, "%s: no header\n", argv[1]);
    return 2;
  }
  std::vector<MoeforgeCopy> ds;
  unsigned long long sr, dr, runs = 0, bytes = 0;
  MoeforgeCopy c{};
  while (std::fscanf(f, "%llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &sr, &dr, &c.src, &c.dst, &c.run,
                     &c.c0, &c.c1, &c.ss0, &c.ss1, &c.ds0, &c.ds1) == 11) {
    c.src += sr * 2 * slot;
    c.dst += dr * 2 * slot + slot;
    runs += c.c0 * c.c1;
    bytes += c.run * c.c0 * c.c1;
    ds.push_back(c);
  }
  std::fclose(f);
  std::ifstream ptx_file(argv[2]);
  std::stringstream ptx;
  ptx << ptx_file.rdbuf();
  std::vector<unsigned long long> table;
  {
    std::ifstream t(argv[3]);
    unsigned long long w;
    while (t >> w) table.push_back(w);
  }
  if (ptx.str().empty() || table.empty()) {
    std::fprintf(stderr, "no PTX in %s or no table in %s\n", argv[2], argv[3]);
    return 2;
  }
  if (ds.empty()) {
    std::fprintf(stderr, "%s: no descriptors\n", argv[1]);
    return 2;
  }
  const size_t total = ranks * 2 * slot;
  std::vector<unsigned char> host(total), expect(total, 0xa5);
  uint64_t x = 0x2545f4914f6cdd1dull;
  for (auto& b : host) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  for (const MoeforgeCopy& d : ds)
    for (unsigned long long a = 0; a < d.c0; ++a)
      for (unsigned long long b = 0; b < d.c1; ++b)
        std::memmove(&expect[d.dst + a * d.ds0 + b * d.ds1], &host[d.src + a * d.ss0 + b * d.ss1], d.run);
  unsigned char *mem, *flat;
  unsigned long long *bases, *words;
  CHECK(cudaMalloc(&mem, total));
  CHECK(cudaMalloc(&flat, std::max<size_t>(bytes, 1)));
  CHECK(cudaMalloc(&bases, ranks * 8));
  CHECK(cudaMalloc(&words, table.size() * 8));
  std::vector<unsigned long long> base(ranks);
  for (unsigned long long r = 0; r < ranks; ++r) base[r] = reinterpret_cast<unsigned long long>(mem) + r * 2 * slot;
  CHECK(cudaMemcpy(bases, base.data(), ranks * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(words, table.data(), table.size() * 8, cudaMemcpyHostToDevice));
  const std::string ptx_text = ptx.str();
  cudaLibrary_t library;
  cudaKernel_t program;
  CHECK(cudaLibraryLoadData(&library, ptx_text.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  CHECK(cudaLibraryGetKernel(&program, library, "moeforge_xfer"));
  // Pieces of this batch: runs × 16-byte pieces bounds the grid (the
  // program's own pieces may be narrower; the grid-stride loop covers them).
  unsigned long long pieces = 0;
  for (const MoeforgeCopy& d : ds) pieces += d.c0 * d.c1 * ((d.run + 15) / 16);
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned grid = static_cast<unsigned>(std::min<unsigned long long>((pieces + 255) / 256, 16ull * sms));
  auto kernel = [&] {
    void* args[] = {&bases, &words};
    CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(program), dim3(grid), dim3(256), args, 0, s));
  };
  auto memcpy2d = [&] {
    for (const MoeforgeCopy& d : ds)
      for (unsigned long long a = 0; a < d.c0; ++a)
        CHECK(cudaMemcpy2DAsync(mem + d.dst + a * d.ds0, d.c1 > 1 ? d.ds1 : d.run, mem + d.src + a * d.ss0,
                                d.c1 > 1 ? d.ss1 : d.run, d.run, d.c1, cudaMemcpyDeviceToDevice, s));
  };
  auto d2d = [&] { CHECK(cudaMemcpyAsync(flat, mem, bytes, cudaMemcpyDeviceToDevice, s)); };
  auto verify = [&](const char* how) {
    std::vector<unsigned char> got(total);
    CHECK(cudaMemcpy(got.data(), mem, total, cudaMemcpyDeviceToHost));
    for (const MoeforgeCopy& d : ds)
      for (unsigned long long a = 0; a < d.c0; ++a)
        for (unsigned long long b = 0; b < d.c1; ++b) {
          const size_t o = d.dst + a * d.ds0 + b * d.ds1;
          if (std::memcmp(&got[o], &expect[o], d.run) != 0) {
            std::fprintf(stderr, "%s: descriptor run at destination byte %zu differs\n", how, o);
            std::exit(1);
          }
        }
  };
  auto time = [&](auto fn) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> ms;
    for (int i = 0; i < repeats; ++i) {
      CHECK(cudaEventRecord(a, s));
      fn();
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventSynchronize(b));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
  };
  // Sources in place, every destination slot poisoned before each way.
  auto reset = [&] {
    CHECK(cudaMemcpy(mem, host.data(), total, cudaMemcpyHostToDevice));
    for (unsigned long long r = 0; r < ranks; ++r) CHECK(cudaMemset(mem + r * 2 * slot + slot, 0xa5, slot));
  };
  reset();
  const double k_us = time(kernel);
  verify("kernel");
  reset();
  const double m_us = time(memcpy2d);
  verify("memcpy2d");
  const double d_us = time(d2d);
  // Bandwidth counts bytes read plus bytes written.
  auto gbs = [&](double us) { return 2.0 * bytes / (us * 1e-6) / 1e9; };
  std::printf(
      "{\"descriptors\": %zu, \"table_words\": %zu, \"runs\": %llu, \"bytes\": %llu, \"kernel_us\": %.1f, \"memcpy2d_us\": %.1f, "
      "\"d2d_us\": %.1f, \"kernel_gbs\": %.1f, \"memcpy2d_gbs\": %.1f, \"d2d_gbs\": %.1f, "
      "\"kernel_vs_d2d\": %.3f, \"memcpy2d_vs_d2d\": %.3f}\n",
      ds.size(), table.size(), runs, bytes, k_us, m_us, d_us, gbs(k_us), gbs(m_us), gbs(d_us), d_us / k_us, d_us / m_us);
  return 0;
}
