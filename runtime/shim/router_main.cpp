// Runs the emitted router (KERNEL_SOURCE) on the host shim.
// in:  i32 tokens, i32 experts, f32 logits[tokens*experts], f32 bias[experts]
// out: i32 topk_ids[tokens*kTopK], f32 topk_weights[tokens*kTopK]
#include "cuda_host.h"
#include KERNEL_SOURCE

#include <cstdio>

static bool read_all(FILE* f, void* p, size_t n) { return std::fread(p, 1, n, f) == n; }

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  int32_t tokens = 0, experts = 0;
  if (!read_all(in, &tokens, 4) || !read_all(in, &experts, 4) || experts != kExperts) return 4;
  std::vector<float> logits(static_cast<size_t>(tokens) * experts), bias(experts);
  if (!read_all(in, logits.data(), logits.size() * 4) || !read_all(in, bias.data(), bias.size() * 4)) return 5;
  std::fclose(in);
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * kTopK, -7);
  std::vector<float> weights(static_cast<size_t>(tokens) * kTopK, -7.0f);
  const unsigned grid = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  shim::launch(moe_router, grid, kWarpsPerBlock * 32, logits.data(), bias.data(), ids.data(), weights.data(), tokens);
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 6;
  std::fwrite(ids.data(), 4, ids.size(), out);
  std::fwrite(weights.data(), 4, weights.size(), out);
  std::fclose(out);
  return 0;
}
