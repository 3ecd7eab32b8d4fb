// Runs every emitted layer kernel (KERNEL_SOURCE) once on the host shim.
// in:  header (i32 tokens, hidden, rows, vocab, q_heads, kv_heads, q_head0,
//      kv_head0, use_sumsq, table_rows, layer, qk_weight_len; f32 k_share;
//      i64 pool_bytes, page_bytes), then i32 ids[tokens], bf16
//      table[table_rows*hidden], f32 x[tokens*hidden], bf16 w[hidden],
//      f32 delta[tokens*hidden], f32 moe[tokens*hidden], bf16
//      shared[tokens*hidden], i32 norm_rows[tokens], f32 logits[rows*vocab],
//      i32 sample_meta[rows*kMetaWords];
//      with GQA: bf16 qkv[tokens*kQkvStride], bf16 qw[len], bf16 kw[len],
//      i32 positions[tokens], i32 slot_map[tokens], f32 sumsq[tokens*2],
//      u8 attention_pool[pool_bytes], i32 requests, i32
//      request_meta[requests*kMetaWords], i32 row_request[tokens], i32
//      attention_positions[tokens].
// out: embed (f32), rms_norm (bf16), add_rms_norm residual (f32) and out
//      (bf16), residual_add with shared (f32) and without (f32), sampled
//      (i32 rows) and the sampling headers after; with GQA: qk_sumsq (f32, when QK-norm), qk_norm's qkv
//      (bf16, when QK-norm), rope's qkv (bf16), the KV pool (bytes),
//      paged_attention's output (bf16, tokens × kHeads·kHeadDim).
#include "cuda_host.h"
#include "cuda_bf16.h"
#include KERNEL_SOURCE

#include <cstdio>

namespace {
FILE* in = nullptr;
template <typename T>
std::vector<T> take(size_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, in) != n) std::exit(5);
  return v;
}
template <typename T>
T one() {
  return take<T>(1)[0];
}
FILE* out = nullptr;
template <typename T>
void put(const std::vector<T>& v) {
  std::fwrite(v.data(), sizeof(T), v.size(), out);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  const int tokens = one<int32_t>(), hidden = one<int32_t>(), rows = one<int32_t>(), vocab = one<int32_t>();
  const int q_heads = one<int32_t>(), kv_heads = one<int32_t>(), q_head0 = one<int32_t>(), kv_head0 = one<int32_t>();
  const int use_sumsq = one<int32_t>(), table_rows = one<int32_t>(), layer = one<int32_t>(), wlen = one<int32_t>();
  const float k_share = one<float>();
  const long long pool_bytes = one<int64_t>(), page_bytes = one<int64_t>();
  if (hidden != kHidden || vocab != kVocab) return 4;
  (void)q_heads, (void)kv_heads, (void)q_head0, (void)kv_head0, (void)use_sumsq, (void)layer, (void)wlen, (void)k_share,
      (void)pool_bytes, (void)page_bytes;
  const size_t th = static_cast<size_t>(tokens) * hidden;
  auto ids = take<int32_t>(tokens);
  auto table = take<__nv_bfloat16>(static_cast<size_t>(table_rows) * hidden);
  auto x = take<float>(th);
  auto w = take<__nv_bfloat16>(hidden);
  auto delta = take<float>(th);
  auto moe = take<float>(th);
  auto shared = take<__nv_bfloat16>(th);
  auto norm_rows = take<int32_t>(tokens);
  auto logits = take<float>(static_cast<size_t>(rows) * vocab);
  // Sampling: row r is request r's; its header carries temperature, top-p, seed.
  auto sample_meta = take<int32_t>(static_cast<size_t>(rows) * kMetaWords);
  out = std::fopen(argv[2], "wb");
  if (!out) return 6;

  std::vector<float> emb(th, -7.0f);
  shim::launch(embed_rows, tokens, kThreads, ids.data(), table.data(), tokens, emb.data());
  put(emb);
  std::vector<__nv_bfloat16> normed(th);
  shim::launch(rms_norm, tokens, kThreads, x.data(), norm_rows.data(), w.data(), tokens, normed.data());
  put(normed);
  auto res = x;
  shim::launch(add_rms_norm, tokens, kThreads, res.data(), delta.data(), w.data(), tokens, normed.data());
  put(res);
  put(normed);
  res = x;
  shim::launch(residual_add, tokens, kThreads, res.data(), moe.data(), shared.data(), tokens);
  put(res);
  res = x;
  shim::launch(residual_add, tokens, kThreads, res.data(), moe.data(), static_cast<const __nv_bfloat16*>(nullptr), tokens);
  put(res);
  std::vector<int32_t> sampled(rows, -7), identity(rows);
  for (int r = 0; r < rows; ++r) identity[r] = r;
  shim::launch(sample_tokens, rows, kThreads, static_cast<const float*>(logits.data()), rows,
               static_cast<const int32_t*>(identity.data()), static_cast<const int32_t*>(identity.data()),
               sample_meta.data(), sampled.data());
  put(sampled);
  put(sample_meta);
#ifdef KERNEL_GQA
  const size_t tq = static_cast<size_t>(tokens) * kQkvStride;
  auto qkv = take<__nv_bfloat16>(tq);
  auto qw = take<__nv_bfloat16>(wlen);
  auto kw = take<__nv_bfloat16>(wlen);
  auto positions = take<int32_t>(tokens);
  auto slots = take<int32_t>(tokens);
  auto sums_in = take<float>(static_cast<size_t>(tokens) * 2);
  auto apool = take<uint8_t>(pool_bytes);
  const int requests = one<int32_t>();
  auto meta = take<int32_t>(static_cast<size_t>(requests) * kMetaWords);
  auto row_request = take<int32_t>(tokens);
  auto apos = take<int32_t>(tokens);
#ifdef KERNEL_QK_NORM
  std::vector<float> sums(static_cast<size_t>(tokens) * 2, -7.0f);
  shim::launch(qk_sumsq, tokens, kThreads, static_cast<const __nv_bfloat16*>(qkv.data()), tokens, q_heads, kv_heads,
               k_share, sums.data());
  put(sums);
  auto normed_qkv = qkv;
  shim::launch(qk_norm, tokens, kThreads, normed_qkv.data(), static_cast<const __nv_bfloat16*>(qw.data()),
               static_cast<const __nv_bfloat16*>(kw.data()), tokens, q_heads, kv_heads, q_head0, kv_head0,
               use_sumsq ? static_cast<const float*>(sums_in.data()) : static_cast<const float*>(nullptr));
  put(normed_qkv);
  // EP: this rank holds every head, and the all-head sums are local.
  auto local_qkv = qkv;
  shim::launch(qk_norm, tokens, kThreads, local_qkv.data(), static_cast<const __nv_bfloat16*>(qw.data()),
               static_cast<const __nv_bfloat16*>(kw.data()), tokens, kHeads, kKvHeads, 0, 0,
               static_cast<const float*>(nullptr));
  put(local_qkv);
#endif
  auto roped = qkv;
  shim::launch(rope, tokens, kThreads, roped.data(), static_cast<const int32_t*>(positions.data()), tokens, q_heads,
               kv_heads);
  put(roped);
  std::vector<uint8_t> pool(pool_bytes, 0);
  shim::launch(kv_write, tokens, kThreads, static_cast<const __nv_bfloat16*>(qkv.data()),
               static_cast<const int32_t*>(slots.data()), tokens, q_heads, kv_heads, pool.data(), page_bytes, layer);
  put(pool);
  std::vector<__nv_bfloat16> attn(static_cast<size_t>(tokens) * kHeads * kHeadDim, __float2bfloat16_rn(-7.0f));
  shim::launch(paged_attention, tokens, kThreads, static_cast<const __nv_bfloat16*>(qkv.data()),
               static_cast<const int32_t*>(apos.data()), static_cast<const int32_t*>(row_request.data()),
               static_cast<const int32_t*>(meta.data()), tokens, q_heads, kv_heads, q_head0, kv_head0,
               static_cast<const uint8_t*>(apool.data()), page_bytes, layer,
               static_cast<const __nv_bfloat16*>(nullptr), attn.data());
  put(attn);
#endif
#ifdef KERNEL_MLA
  // MLA: qkv, q_a weight (q_lora, may be empty), kv_a weight, kv_b rows of
  // the local heads, positions, slots, an attention pool, request tables.
  const size_t tq = static_cast<size_t>(tokens) * kQkvStride;
  auto qkv = take<__nv_bfloat16>(tq);
  const int q_lora = one<int32_t>();
  auto qaw = take<__nv_bfloat16>(q_lora);
  auto kvaw = take<__nv_bfloat16>(kKvLora);
#ifdef LAYER_KV_B_FP8
  // fp8 kv_b: e4m3 codes, then one f32 scale per 128×128 block.
  const size_t kvb_rows = static_cast<size_t>(q_heads) * kKvb;
  auto kv_b = take<uint8_t>(kvb_rows * kKvLora);
  auto kv_b_scale = take<float>((kvb_rows + kScaleBlock - 1) / kScaleBlock * kKvbScaleCols);
#else
  auto kv_b = take<__nv_bfloat16>(static_cast<size_t>(q_heads) * kKvb * kKvLora);
#endif
  auto positions = take<int32_t>(tokens);
  auto slots = take<int32_t>(tokens);
  auto apool = take<uint8_t>(pool_bytes);
  const int requests = one<int32_t>();
  auto meta = take<int32_t>(static_cast<size_t>(requests) * kMetaWords);
  auto row_request = take<int32_t>(tokens);
  auto apos = take<int32_t>(tokens);
  auto normed_qkv = qkv;
  if (q_lora > 0) shim::launch(latent_norm, tokens, kThreads, normed_qkv.data(), tokens, 0, q_lora, static_cast<const __nv_bfloat16*>(qaw.data()));
  shim::launch(latent_norm, tokens, kThreads, normed_qkv.data(), tokens, kKvOffset, kKvLora, static_cast<const __nv_bfloat16*>(kvaw.data()));
  put(normed_qkv);
  auto roped = qkv;
  shim::launch(mla_rope, tokens, kThreads, roped.data(), static_cast<const int32_t*>(positions.data()), tokens, q_heads);
  put(roped);
  std::vector<uint8_t> pool(pool_bytes, 0);
  shim::launch(mla_kv_write, tokens, kThreads, static_cast<const __nv_bfloat16*>(qkv.data()),
               static_cast<const int32_t*>(slots.data()), tokens, pool.data(), page_bytes, layer);
  put(pool);
  std::vector<__nv_bfloat16> attn(static_cast<size_t>(tokens) * kMlaHeads * kVHead, __float2bfloat16_rn(-7.0f));
  shim::launch(mla_attention, tokens, kThreads, static_cast<const __nv_bfloat16*>(qkv.data()),
               static_cast<const int32_t*>(apos.data()), static_cast<const int32_t*>(row_request.data()),
               static_cast<const int32_t*>(meta.data()), tokens, q_heads,
#ifdef LAYER_KV_B_FP8
               static_cast<const uint8_t*>(kv_b.data()), static_cast<const float*>(kv_b_scale.data()),
#else
               static_cast<const __nv_bfloat16*>(kv_b.data()),
#endif
               static_cast<const uint8_t*>(apool.data()), page_bytes, layer, attn.data());
  put(attn);
#endif
  std::fclose(in);
  std::fclose(out);
  return 0;
}
