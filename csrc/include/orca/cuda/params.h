// Torch-free interface between the CUDA launchers (csrc/cuda/*.cpp, which validate tensors with
// ATen) and the kernels (csrc/cuda/*.cu, which include only the headers in this folder).
// Everything here is plain host C++: launch parameters, the shape-only attention work plan and
// the launch functions.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace orca::cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// How the KV cache stores K and V: in q's dtype, or as float8 e4m3 values (kv_cache_dtype
// "fp8_e4m3", no scale), widened to q's dtype when read.
enum class KvFormat { kSameAsQ, kFp8E4M3 };

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- ragged_attention ------------------------------------------------------------------------

// Tensor-core kernel geometry (shared by the planner and the kernel).
constexpr int kAttnThreads = 128;     // 4 warps
constexpr int kAttnBlockN = 64;       // KV positions per shared-memory tile
constexpr int kAttnStages = 2;        // cp.async pipeline depth
constexpr int kAttnPad = 8;           // elements of padding per smem row (bank-conflict free)
constexpr int kAttnMinChunk = 256;    // never split a request's KV below this many positions
constexpr int kAttnMaxSplits = 64;    // most KV splits of one request
constexpr int kAttnMaxBatchTC = 8192; // tensor-core path keeps a per-request prefix in smem

inline bool attention_tc_head_dim(int d) {
  return d == 32 || d == 64 || d == 80 || d == 96 || d == 128;
}

struct AttentionParams {
  const void* q;  // [T, Hq, D], last dim contiguous
  int64_t q_stride_token, q_stride_head;  // in elements
  const void* k_cache;  // [num_blocks, block_size, Hkv, D] contiguous, q's dtype or fp8 (plan)
  const void* v_cache;
  void* out;            // [T, Hq, D] contiguous
  float* part_o;        // [T * Hq * max_splits, D]   split partials (normalized), or null
  float* part_lse;      // [T * Hq * max_splits]      their log2-sum-exp, or null
  int32_t* split_chunk; // [1] the KV chunk the attention kernel chose, for the merge kernel
  const int32_t* cu_q_lens;     // [B + 1]
  const int32_t* context_lens;  // [B]
  const int32_t* block_table;   // [B, max_blocks]
  int64_t num_blocks;
  int32_t num_tokens, batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int32_t block_shift;  // log2(block_size) when it is a power of two, else -1
  int32_t max_context; // attention_max_context(): context_lens are clamped to [0, max_context]
  int32_t max_splits;  // most KV splits of one request (plan); 1 = no split, no merge
  int32_t window;      // sliding window: the query at pos sees keys (pos - window, pos]; 0: none
  float scale_log2;    // softmax scale * log2(e)
};

// How one call is partitioned: computed from shapes only (no device reads), so the launch
// sequence is fixed for fixed shapes and can be captured in a CUDA graph. The KV chunk length
// is chosen on the device from the longest context of the batch (attention.cuh: split_chunk),
// so a block table padded past the contexts (as for CUDA graphs) only bounds max_splits.
struct AttentionPlan {
  bool tensor_cores = false;  // false: the simple CUDA-core kernel (fp32, odd head dims)
  KvFormat kv_format = KvFormat::kSameAsQ;
  int warps_m = 4;            // query-row warps per CTA: 4 (prefill, 64 rows) or 1 (decode, 16)
  int32_t max_splits = 1;     // most KV splits of one request
  int64_t grid_x = 0;         // CTAs per KV head (they loop over the device-side work list)
  size_t smem_bytes = 0;
  int64_t partial_rows = 0;   // rows of part_o / part_lse (0 when max_splits == 1)
};

// Test-only caps on the plan (0 = none; the launcher takes them from csrc/cuda/test_limits.h),
// so tests can make small batches loop over many items per CTA, or run long contexts unsplit.
struct AttentionLimits {
  int64_t max_ctas = 0;    // CTAs per KV head of the tensor-core kernel
  int32_t max_splits = 0;  // KV splits of one request
};

// The tensor-core kernel's dynamic shared memory: the Q tile and the K/V stages in q's 16-bit
// dtype, an fp8 cache's K/V stages as read (widened into the 16-bit stages), then the
// per-request prefix.
inline size_t attention_smem_bytes(int warps_m, int head_dim, int batch, KvFormat kv_format) {
  const size_t row = static_cast<size_t>(head_dim + kAttnPad) * 2;  // 16-bit elements
  const size_t tiles = (16 * warps_m + 2 * kAttnStages * kAttnBlockN) * row;
  const size_t fp8_tiles = kv_format == KvFormat::kFp8E4M3
                               ? static_cast<size_t>(2 * kAttnStages * kAttnBlockN) * head_dim
                               : 0;
  const size_t prefix = ((static_cast<size_t>(batch) + 1) * 4 + 15) / 16 * 16;
  return tiles + fp8_tiles + prefix;
}

inline int32_t block_size_shift(int64_t block_size) {
  for (int32_t s = 0; s < 31; ++s) {
    if ((int64_t{1} << s) == block_size) return s;
  }
  return -1;
}

// Longest context the block table can address (clamped so positions fit in int32).
inline int32_t attention_max_context(int64_t block_size, int64_t max_blocks) {
  return static_cast<int32_t>(std::min<int64_t>(max_blocks * block_size, int64_t{1} << 30));
}

inline AttentionPlan plan_attention(int64_t T, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                    int64_t block_size, int64_t max_blocks, DType dtype,
                                    KvFormat kv_format, bool aligned16, int num_sms,
                                    const AttentionLimits& limits = {}) {
  AttentionPlan p;
  p.kv_format = kv_format;
  // The block table's capacity bounds the contexts (the kernel clamps them to it).
  const int64_t ctx_cap = std::max<int64_t>(1, attention_max_context(block_size, max_blocks));
  p.tensor_cores = dtype != DType::kFloat32 && attention_tc_head_dim(static_cast<int>(D)) &&
                   B <= kAttnMaxBatchTC && aligned16;
  if (!p.tensor_cores) {
    p.grid_x = div_up(T * Hq, kAttnThreads / 32);
    return p;
  }
  const int64_t g = Hq / Hkv;
  // Decode-like batches (at most 16 query rows per request on average) use 16-row tiles whose
  // four warps split each KV tile; otherwise 64-row tiles, one 16-row slice per warp.
  p.warps_m = (T * g <= 16 * B) ? 1 : 4;
  const int64_t bm = 16 * p.warps_m;
  // Upper bound on the number of row tiles of all requests (rows = q_len * group).
  const int64_t tiles = std::max<int64_t>(
      1, std::min(div_up(T * g, bm) + B, T * div_up(g, bm)));
  const int64_t base = tiles * Hkv, target = 4 * static_cast<int64_t>(num_sms);
  int64_t splits = 1;
  if (base < target && ctx_cap > 2 * kAttnMinChunk) {
    splits = std::min({div_up(target, base), ctx_cap / kAttnMinChunk,
                       static_cast<int64_t>(kAttnMaxSplits)});
    // Keep the fp32 partials within 256 MiB.
    const int64_t per_split = T * Hq * (D + 1) * 4;
    splits = std::max<int64_t>(1, std::min(splits, (int64_t{256} << 20) / per_split));
  }
  if (limits.max_splits > 0) splits = std::min<int64_t>(splits, limits.max_splits);
  p.max_splits = static_cast<int32_t>(splits);
  if (p.max_splits > 1) p.partial_rows = T * Hq * p.max_splits;
  const int64_t items = tiles * p.max_splits;
  // About 8 CTAs per SM in all (2-3 resident waves): each CTA rebuilds the per-request prefix
  // once, then loops over its items.
  p.grid_x = std::max<int64_t>(1, std::min(items, div_up(8 * int64_t{num_sms}, Hkv)));
  if (limits.max_ctas > 0) p.grid_x = std::min(p.grid_x, limits.max_ctas);
  p.smem_bytes =
      attention_smem_bytes(p.warps_m, static_cast<int>(D), static_cast<int>(B), kv_format);
  return p;
}

// Launches the attention kernel (and the merge kernel when plan.max_splits > 1) on `stream`.
cudaError_t launch_ragged_attention(const AttentionParams& p, const AttentionPlan& plan,
                                    DType dtype, cudaStream_t stream);

// ---- store_kv ----------------------------------------------------------------------------------

struct StoreKvParams {
  const void* key;    // [T, H, D], last dim contiguous
  const void* value;
  void* k_cache;      // [num_slots, H, D] contiguous
  void* v_cache;
  const int64_t* slot_mapping;  // [T]
  int64_t num_tokens, num_slots, num_heads, row_bytes;         // a cache row: D elements
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;  // bytes
};
// A cache in key's dtype: rows copied as they are.
cudaError_t launch_store_kv(const StoreKvParams& p, cudaStream_t stream);
// An fp8 cache (row_bytes = D): key/value of `key_dtype` rounded to nearest even, saturated.
cudaError_t launch_store_kv_fp8(const StoreKvParams& p, DType key_dtype, cudaStream_t stream);

// ---- apply_token_bitmask -----------------------------------------------------------------------

// logits[rows[i], t] = -inf wherever bit t % 32 of bitmask[i, t / 32] is clear (t < vocab).
struct TokenBitmaskParams {
  void* logits;                 // [B, vocab], last dim contiguous
  const int32_t* bitmask;       // [num_masks, words] contiguous
  const int64_t* rows;          // [num_masks] logits row of each mask, or null: row i
  int64_t num_masks, num_rows, vocab, words, logits_row_stride;  // stride in elements
  int32_t element_bytes;        // 4 (float32) or 2 (bfloat16, float16)
  uint32_t neg_inf_bits;        // -inf's bit pattern in the logits' dtype
};
cudaError_t launch_apply_token_bitmask(const TokenBitmaskParams& p, cudaStream_t stream);

// ---- packed_linear epilogues -------------------------------------------------------------------

enum class Act { kNone = 0, kGeluTanh = 1, kRelu = 2, kSiluAndMul = 3, kGeluTanhAndMul = 4 };

// Gated acts: weight rows gate rows then up rows, out = act(gate) * up (silu or gelu_tanh).
__host__ __device__ constexpr bool act_gated(Act act) {
  return act == Act::kSiluAndMul || act == Act::kGeluTanhAndMul;
}

// Skinny GEMM with a fused epilogue for few tokens: out[t, n] = act(x[t] . w[n] + b[n]); for
// a gated act out[t, n] = act(x[t] . w[n] + b[n]) * (x[t] . w[N + n] + b[N + n]).
struct SkinnyLinearParams {
  const void* x;       // [T, K], rows 16-byte aligned
  const void* weight;  // [N or 2N, K], rows 16-byte aligned
  const void* bias;    // [N or 2N] or null
  void* out;           // [T, N] contiguous
  int64_t T, N, K, x_stride, w_stride;  // strides in elements
  Act act;
};
constexpr int kSkinnyMaxT = 8;
cudaError_t launch_skinny_linear(const SkinnyLinearParams& p, DType dtype, cudaStream_t stream);

// In-place y[T, N] = act(y + bias) (bias may be null; act is not gated).
cudaError_t launch_bias_act(void* y, const void* bias, int64_t T, int64_t N, Act act, DType dtype,
                            cudaStream_t stream);
// out[T, I] = act(y[:, :I]) * y[:, I:] for y [T, 2I] contiguous and a gated act.
cudaError_t launch_act_and_mul(const void* y, void* out, int64_t T, int64_t I, Act act,
                               DType dtype, cudaStream_t stream);

}  // namespace orca::cuda
