// Runs the emitted permutation kernels (KERNEL_SOURCE) on the host shim, with
// a stand-in for the grouped GEMMs between gather and combine:
//   y[row][j] = bf16(x_perm[row][j] * (row_expert[row] + 1) * 0.5)
// in:  i32 tokens, i32 expert_begin, i32 num_local, i32 room (rows the layout may fill),
//      i32 topk_ids[tokens*kTopK], f32 topk_weights[tokens*kTopK], u16 x[tokens*kHidden] (bf16 bits)
// out: i32 counts[num_local], i32 offsets[num_local+1], i32 rows (offsets[num_local]: -1 refused),
//      i32 overflow, then with R = max(rows, 0):
//      i32 row_entry[R], i32 row_expert[R], i32 entry_row[tokens*kTopK],
//      u16 x_perm[R*kHidden], u16 out[tokens*kHidden] (moe_combine),
//      f32 out_f32[tokens*kHidden] (moe_combine_f32)
#include "cuda_host.h"
#include KERNEL_SOURCE

#include <algorithm>
#include <cstdio>

static bool read_all(FILE* f, void* p, size_t n) { return std::fread(p, 1, n, f) == n; }

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  int32_t tokens = 0, expert_begin = 0, num_local = 0, room = 0;
  if (!read_all(in, &tokens, 4) || !read_all(in, &expert_begin, 4) || !read_all(in, &num_local, 4) ||
      !read_all(in, &room, 4))
    return 4;
  const int entries = tokens * kTopK;
  std::vector<int32_t> ids(entries);
  std::vector<float> weights(entries);
  std::vector<uint16_t> x(static_cast<size_t>(tokens) * kHidden);
  if (!read_all(in, ids.data(), ids.size() * 4) || !read_all(in, weights.data(), weights.size() * 4) ||
      !read_all(in, x.data(), x.size() * 2))
    return 5;
  std::fclose(in);

  std::vector<int32_t> counts(num_local, -7), offsets(num_local + 1, -7), entry_row(entries, -7);
  shim::launch(moe_count, num_local, kThreads, ids.data(), entries, expert_begin, num_local, counts.data(),
               entry_row.data());
  int32_t overflow = 0;
  shim::launch(moe_offsets, 1, 32, counts.data(), num_local, room, offsets.data(), &overflow);
  // The driver reads the total to size its arrays; the kernels read it on the device.
  const int rows = offsets[num_local];
  const int held = std::max(rows, 0);
  std::vector<int32_t> row_entry(held, -7), row_expert(held, -7);
  shim::launch(moe_scatter, num_local, kThreads, static_cast<const int32_t*>(ids.data()), entries, expert_begin,
               static_cast<const int32_t*>(counts.data()), static_cast<const int32_t*>(offsets.data()),
               row_entry.data(), row_expert.data(), entry_row.data());
  std::vector<uint16_t> x_perm(static_cast<size_t>(held) * kHidden, 0xdead);
  const unsigned vec_threads = std::min(kThreads, kRowVectors);
  // A fixed grid of 3 blocks strides over the rows (as the plan's one block per SM does).
  shim::launch(moe_gather, 3, vec_threads, reinterpret_cast<const uint4*>(x.data()),
               static_cast<const int32_t*>(row_entry.data()), static_cast<const int32_t*>(offsets.data()), num_local,
               reinterpret_cast<uint4*>(x_perm.data()));
  std::vector<uint16_t> y(x_perm.size());
  for (int r = 0; r < held; ++r) {
    const float scale = static_cast<float>(row_expert[r] + 1) * 0.5f;
    for (int j = 0; j < kHidden; ++j) {
      const size_t i = static_cast<size_t>(r) * kHidden + j;
      y[i] = shim_float_to_bf16(shim_bf16_to_float(__nv_bfloat16{x_perm[i]}) * scale).bits;
    }
  }
  std::vector<uint16_t> out(static_cast<size_t>(tokens) * kHidden, 0xdead);
  shim::launch(moe_combine, std::max(1, std::min(tokens, 8)), vec_threads, reinterpret_cast<const uint4*>(y.data()),
               static_cast<const int32_t*>(entry_row.data()), static_cast<const float*>(weights.data()), tokens,
               reinterpret_cast<uint4*>(out.data()));
  std::vector<float> out_f32(static_cast<size_t>(tokens) * kHidden, -7.0f);
  shim::launch(moe_combine_f32, std::max(1, std::min(tokens, 8)), vec_threads, reinterpret_cast<const uint4*>(y.data()),
               static_cast<const int32_t*>(entry_row.data()), static_cast<const float*>(weights.data()), tokens,
               reinterpret_cast<float4*>(out_f32.data()));

  FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 6;
  std::fwrite(counts.data(), 4, counts.size(), o);
  std::fwrite(offsets.data(), 4, offsets.size(), o);
  std::fwrite(&rows, 4, 1, o);
  std::fwrite(&overflow, 4, 1, o);
  std::fwrite(row_entry.data(), 4, row_entry.size(), o);
  std::fwrite(row_expert.data(), 4, row_expert.size(), o);
  std::fwrite(entry_row.data(), 4, entry_row.size(), o);
  std::fwrite(x_perm.data(), 2, x_perm.size(), o);
  std::fwrite(out.data(), 2, out.size(), o);
  std::fwrite(out_f32.data(), 4, out_f32.size(), o);
  std::fclose(o);
  return 0;
}
