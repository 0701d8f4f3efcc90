// Torch-free CUDA kernels of ragged (split-and-merge) paged attention.
//
// One launch handles a mixed prefill + decode batch. Work items are (request, KV head, tile of
// query rows, KV split). A request's query rows are its tokens x the query heads of one KV
// head's group (row = token * group + head_in_group), so GQA shares every K/V load across its
// group. The partition is computed on the device from the metadata: each CTA builds the
// per-request item prefix sums in shared memory and then loops over items
// blockIdx.x, blockIdx.x + gridDim.x, ...; the host only picks the grid and the KV chunk
// length from shapes (plan_attention), so nothing is read back and the launch sequence can be
// captured in a CUDA graph.
//
// Tensor-core kernel (bf16/fp16, head_dim 32/64/80/96/128): FlashAttention-2 style, Q tile in
// registers, K/V tiles gathered from the paged cache by cp.async into a 2-stage shared-memory
// pipeline, S = QK^T and O += PV with mma.sync m16n8k16, online softmax in base 2. Prefill
// tiles have 64 rows (one 16-row slice per warp); decode tiles have 16 rows and the four warps
// split every KV tile and combine at the end. A request whose KV range is split into chunks
// writes normalized fp32 partials + log2-sum-exp, merged by merge_kernel; unsplit requests
// write the output directly. The chunk length is chosen on the device from the batch's longest
// context (split_chunk), so it does not depend on how far the block table is padded.
// An fp8 e4m3 cache (KV = __nv_fp8_e4m3) is copied by cp.async into fp8 stages of its own and
// widened into the 16-bit stages once a tile has landed, so the MMA loop is the same.
//
// With a sliding window (p.window > 0) the query at pos sees keys (pos - window, pos]: a
// request's KV splits cover only [kv_start, ctx), kv_start its first query's window start (the
// longest such span picks the chunk), an item reads only from its first row's window start, and
// the merge combines only the splits a row's window reaches. window = 0 is plain causal.
//
// Metadata values are never trusted: cu_q_lens and context_lens are clamped into range, KV
// positions past the block table are never read, and a block id outside [0, num_blocks) is not
// dereferenced (its K/V read as zeros, or are skipped by the simple kernel). The result for
// such metadata is unspecified but memory-safe.
#pragma once

#include <type_traits>

#include "orca/cuda/common.cuh"
#include "orca/cuda/params.h"

namespace orca::cuda::attn {

struct Request {
  int q_start, q_len, ctx, first_pos, kv_start, num_splits;
};

__device__ __forceinline__ int clamp_int(int v, int lo, int hi) { return min(max(v, lo), hi); }

// The first KV position the query at pos sees (0 without a window).
__device__ __forceinline__ int window_start(const AttentionParams& p, int pos) {
  return p.window > 0 ? max(0, pos - p.window + 1) : 0;
}

__device__ __forceinline__ int context_of(const AttentionParams& p, int r) {
  return clamp_int(__ldg(p.context_lens + r), 0, p.max_context);
}

// Sanitized metadata of request r; num_splits = KV chunks of kv_chunk positions (>= 1) over
// the positions [kv_start, ctx) its queries see.
__device__ __forceinline__ Request load_request(const AttentionParams& p, int r, int kv_chunk) {
  Request q;
  const int a = clamp_int(__ldg(p.cu_q_lens + r), 0, p.num_tokens);
  const int b = clamp_int(__ldg(p.cu_q_lens + r + 1), a, p.num_tokens);
  q.q_start = a;
  q.q_len = b - a;
  q.ctx = context_of(p, r);
  q.first_pos = q.ctx - q.q_len;
  q.kv_start = window_start(p, q.first_pos);
  q.num_splits = max(1, (q.ctx - q.kv_start + kv_chunk - 1) / kv_chunk);
  return q;
}

// KV positions per split, from the batch's longest context: no split up to 2 * kAttnMinChunk
// positions, else the most chunks (up to max_splits) of at least kAttnMinChunk positions each,
// rounded up to whole KV tiles. Every request then has at most max_splits chunks.
__device__ __forceinline__ int split_chunk(int longest, int max_splits) {
  int chunk = max(longest, 1);
  if (max_splits > 1 && longest > 2 * kAttnMinChunk) {
    const int splits = min(max_splits, longest / kAttnMinChunk);
    chunk = (longest + splits - 1) / splits;
  }
  return (chunk + kAttnBlockN - 1) / kAttnBlockN * kAttnBlockN;
}

// The request whose token rows contain `token`, or -1 (binary search on the clamped offsets).
__device__ __forceinline__ int find_request(const AttentionParams& p, int token) {
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (clamp_int(__ldg(p.cu_q_lens + mid), 0, p.num_tokens) <= token) lo = mid;
    else hi = mid - 1;
  }
  if (p.batch <= 0) return -1;
  const int a = clamp_int(__ldg(p.cu_q_lens + lo), 0, p.num_tokens);
  const int b = clamp_int(__ldg(p.cu_q_lens + lo + 1), a, p.num_tokens);
  return (token >= a && token < b) ? lo : -1;
}

// How a cache of KV values is read by kernels of q's dtype T (the plan's kv_format).
template <typename T, typename KV>
constexpr KvFormat kv_format_of() {
  return std::is_same_v<KV, T> ? KvFormat::kSameAsQ : KvFormat::kFp8E4M3;
}

// ---- tensor-core kernel ----------------------------------------------------------------------

// Widens one BN x D fp8 tile (rows of D bytes) into a 16-bit tile of row stride LD.
template <typename T, int D, int LD>
__device__ __forceinline__ void widen_fp8_tile(const uint8_t* src, T* dst, int tid) {
  constexpr int C8 = D / 8;  // 8-value chunks per row
  for (int c = tid; c < kAttnBlockN * C8; c += kAttnThreads) {
    const int row = c / C8, col = c % C8;
    const uint2 raw = *reinterpret_cast<const uint2*>(src + row * D + col * 8);
    uint4 wide;
    wide.x = fp8x2_to<T>(static_cast<uint16_t>(raw.x));
    wide.y = fp8x2_to<T>(static_cast<uint16_t>(raw.x >> 16));
    wide.z = fp8x2_to<T>(static_cast<uint16_t>(raw.y));
    wide.w = fp8x2_to<T>(static_cast<uint16_t>(raw.y >> 16));
    *reinterpret_cast<uint4*>(dst + row * LD + col * 8) = wide;
  }
}

template <typename T, int D, int WM, typename KV = T>
__global__ void __launch_bounds__(kAttnThreads, 2) attention_tc_kernel(const AttentionParams p) {
  constexpr bool kFp8 = std::is_same_v<KV, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<KV, T>, "the cache holds q's dtype or fp8 e4m3");
  constexpr int BM = 16 * WM;           // query rows per tile
  constexpr int BN = kAttnBlockN;       // KV positions per smem tile
  constexpr int WN = 4 / WM;            // warps sharing one 16-row slice (split the KV tile)
  constexpr int BNW = BN / WN;          // KV columns per warp
  constexpr int LD = D + kAttnPad;      // smem row stride (elements)
  constexpr int CH = D / 8;             // 16-byte chunks per row
  constexpr int LDO = D + 8;            // fp32 epilogue row stride (float2 stores conflict-free)
  constexpr int NT = BNW / 8;           // S n-tiles per warp
  constexpr int DT = D / 8;             // O n-tiles
  static_assert(D % 16 == 0 && BNW % 16 == 0, "tile shape");
  static_assert((WN * BM * LDO + 2 * WN * BM) * sizeof(float) <=
                    2 * kAttnStages * BN * LD * sizeof(T),
                "the epilogue overlay must fit in the K/V tiles");

  ORCA_DYNAMIC_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * LD;
  T* sV = sK + kAttnStages * BN * LD;
  // fp8 stages (BN x D bytes each), present only for an fp8 cache.
  uint8_t* sK8 = reinterpret_cast<uint8_t*>(sV + kAttnStages * BN * LD);
  uint8_t* sV8 = sK8 + (kFp8 ? kAttnStages * BN * D : 0);
  int* sPrefix = reinterpret_cast<int*>(sV8 + (kFp8 ? kAttnStages * BN * D : 0));
  float* sO = reinterpret_cast<float*>(sK);  // epilogue overlay of the K/V tiles
  float* sM = sO + WN * BM * LDO;
  float* sL = sM + WN * BM;
  __shared__ int sWarpSum[kAttnThreads / 32];
  __shared__ int sWarpMax[kAttnThreads / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WM, wc = warp / WM;
  const int h = blockIdx.y;
  const int g = p.num_q_heads / p.num_kv_heads;
  const int B = p.batch;

  // Each thread owns the requests [begin, end) for the two passes over the metadata.
  const int per = (B + kAttnThreads - 1) / kAttnThreads;
  const int begin = min(tid * per, B), end = min(begin + per, B);

  // 1. The longest span of KV a request's queries see (its context without a window) -> this
  //    launch's KV chunk (the same in every CTA); CTA (0, 0) leaves it for the merge kernel.
  int kv_chunk;
  {
    int longest = 0;
    for (int r = begin; r < end; ++r) {
      if (p.window > 0) {
        const Request rq = load_request(p, r, max(p.max_context, 1));
        longest = max(longest, rq.ctx - rq.kv_start);
      } else {
        longest = max(longest, context_of(p, r));
      }
    }
    longest = warp_max(longest);
    if (lane == 0) sWarpMax[warp] = longest;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kAttnThreads / 32; ++w) longest = max(longest, sWarpMax[w]);
    kv_chunk = split_chunk(longest, p.max_splits);
    if (p.max_splits > 1 && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) {
      *p.split_chunk = kv_chunk;
    }
  }

  // 2. Items per request -> exclusive prefix sums in shared memory.
  {
    int sum = 0;
    for (int r = begin; r < end; ++r) {
      const Request rq = load_request(p, r, kv_chunk);
      const int c = (rq.q_len * g + BM - 1) / BM * rq.num_splits;
      sPrefix[r] = c;
      sum += c;
    }
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    if (lane == 31) sWarpSum[warp] = incl;
    __syncthreads();
    int excl = incl - sum;
    for (int w = 0; w < warp; ++w) excl += sWarpSum[w];
    for (int r = begin; r < end; ++r) {
      const int c = sPrefix[r];
      sPrefix[r] = excl;
      excl += c;
    }
    if (tid == kAttnThreads - 1) sPrefix[B] = excl;
    __syncthreads();
  }
  const int total = sPrefix[B];

  const T* q_ptr = static_cast<const T*>(p.q);
  const KV* k_ptr = static_cast<const KV*>(p.k_cache);
  const KV* v_ptr = static_cast<const KV*>(p.v_cache);

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    // 3. Decode the item.
    int r = 0;
    {
      int lo = 0, hi = B - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (sPrefix[mid] <= item) lo = mid;
        else hi = mid - 1;
      }
      r = lo;
    }
    const Request rq = load_request(p, r, kv_chunk);
    const int rows = rq.q_len * g;
    const int local = item - sPrefix[r];
    const int num_tiles = (rows + BM - 1) / BM;
    const int tile = num_tiles - 1 - local / rq.num_splits;  // longest causal ranges first
    const int split = local % rq.num_splits;
    const int m0 = tile * BM;
    const int last_row = min(m0 + BM, rows) - 1;
    const int pos_max = rq.first_pos + last_row / g;
    // The split's positions from the first row's window start (the earliest of the tile's).
    const int split_lo = rq.kv_start + split * kv_chunk;
    const int kv_lo = max(split_lo, window_start(p, rq.first_pos + m0 / g));
    const int kv_hi = min(min(split_lo + kv_chunk, rq.ctx), pos_max + 1);
    const int n_kv_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + BN - 1) / BN : 0;
    // Columns in [nomask_lo, nomask_hi) are visible to every row of the tile.
    const int nomask_lo = window_start(p, pos_max);
    const int nomask_hi = min(kv_hi, rq.first_pos + m0 / g + 1);
    const bool to_out = rq.num_splits == 1;
    if (!to_out && n_kv_tiles == 0) continue;  // no row of this tile reaches this split

    const int32_t* blocks = p.block_table + static_cast<int64_t>(r) * p.max_blocks;

    // 4. Q tile -> smem (rows past the request read as zeros).
    for (int c = tid; c < BM * CH; c += kAttnThreads) {
      const int row = c / CH, col = c % CH, gm = m0 + row;
      const bool valid = gm < rows;
      const T* src = q_ptr;
      if (valid) {
        src = q_ptr + static_cast<int64_t>(rq.q_start + gm / g) * p.q_stride_token +
              static_cast<int64_t>(h * g + gm % g) * p.q_stride_head + col * 8;
      }
      cp_async16(sQ + row * LD + col * 8, src, valid);
    }
    // cp.async of KV tile t into `stage`: 16-byte chunks of 8 16-bit or 16 fp8 values.
    constexpr int CHUNK = 16 / sizeof(KV);  // values per chunk
    constexpr int CHK = D / CHUNK;          // chunks per row
    auto load_kv = [&](int t, int stage) {
      const int kv0 = kv_lo + t * BN;
      for (int c = tid; c < BN * CHK; c += kAttnThreads) {
        const int row = c / CHK, col = c % CHK, kv = kv0 + row;
        bool valid = kv < kv_hi;
        int64_t off = 0;
        if (valid) {
          int bi, bo;  // block index in the table, offset in the block
          if (p.block_shift >= 0) {
            bi = kv >> p.block_shift;
            bo = kv & (p.block_size - 1);
          } else {
            bi = kv / p.block_size;
            bo = kv - bi * p.block_size;
          }
          const int blk = __ldg(blocks + bi);
          valid = blk >= 0 && blk < p.num_blocks;
          off = valid ? ((static_cast<int64_t>(blk) * p.block_size + bo) * p.num_kv_heads + h) *
                                D + col * CHUNK
                      : 0;
        }
        if constexpr (kFp8) {
          cp_async16(sK8 + (stage * BN + row) * D + col * CHUNK, k_ptr + off, valid);
          cp_async16(sV8 + (stage * BN + row) * D + col * CHUNK, v_ptr + off, valid);
        } else {
          cp_async16(sK + (stage * BN + row) * LD + col * CHUNK, k_ptr + off, valid);
          cp_async16(sV + (stage * BN + row) * LD + col * CHUNK, v_ptr + off, valid);
        }
      }
    };
#pragma unroll
    for (int st = 0; st < kAttnStages - 1; ++st) {  // Q rides in the first group
      if (st < n_kv_tiles) load_kv(st, st);
      cp_async_commit();
    }

    // Per-thread state: rows i0 = lane/4 and i0 + 8 of this warp's 16-row slice.
    const int row0 = m0 + wr * 16 + (lane >> 2), row1 = row0 + 8;
    const int pos0 = row0 < rows ? rq.first_pos + row0 / g : -1;
    const int pos1 = row1 < rows ? rq.first_pos + row1 / g : -1;
    const int start0 = window_start(p, pos0), start1 = window_start(p, pos1);
    const bool warp_active = m0 + wr * 16 < rows;
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    uint32_t qf[D / 16][4];

    for (int t = 0; t < n_kv_tiles; ++t) {
      cp_async_wait<kAttnStages - 2>();
      __syncthreads();
      if constexpr (kFp8) {  // tile t has landed in its fp8 stage: widen it
        const int st = t % kAttnStages;
        widen_fp8_tile<T, D, LD>(sK8 + st * BN * D, sK + st * BN * LD, tid);
        widen_fp8_tile<T, D, LD>(sV8 + st * BN * D, sV + st * BN * LD, tid);
      }
      if (t + kAttnStages - 1 < n_kv_tiles) {
        load_kv(t + kAttnStages - 1, (t + kAttnStages - 1) % kAttnStages);
      }
      cp_async_commit();
      if constexpr (kFp8) __syncthreads();  // the widened tile is visible to every warp
      if (!warp_active) continue;
      if (t == 0) {
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
          ldmatrix_x4(qf[kc], sQ + (wr * 16 + (lane & 15)) * LD + kc * 16 + ((lane >> 4) << 3));
        }
      }
      const int stage = t % kAttnStages;
      const T* ks = sK + stage * BN * LD;
      const T* vs = sV + stage * BN * LD;
      const int kv0 = kv_lo + t * BN;

      // S = Q K^T for this warp's BNW columns.
      float s[NT][4];
#pragma unroll
      for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t b[4];
          const int n = wc * BNW + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int k = kc * 16 + (((lane >> 3) & 1) << 3);
          ldmatrix_x4(b, ks + n * LD + k);
          mma_16816<T>(s[2 * np], qf[kc], b[0], b[1]);
          mma_16816<T>(s[2 * np + 1], qf[kc], b[2], b[3]);
        }
      }

      // Online softmax (base 2).
      const bool need_mask = kv0 + BN > nomask_hi || kv0 < nomask_lo;
      const int col_base = kv0 + wc * BNW + ((lane & 3) << 1);
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[nt][e] * p.scale_log2;
          if (need_mask) {
            const int kv = col_base + nt * 8 + (e & 1);
            const int pos = (e < 2) ? pos0 : pos1, start = (e < 2) ? start0 : start1;
            if (kv > pos || kv >= kv_hi || kv < start) v = neg_inf();
          }
          s[nt][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      }
      float m_use[2], alpha[2], rsum[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float m_new = fmaxf(m_run[i], mx[i]);
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;  // fully masked so far: exp2(-inf) = 0
        alpha[i] = fast_exp2(m_run[i] - m_use[i]);
        m_run[i] = m_new;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = fast_exp2(s[nt][e] - m_use[e >> 1]);
          s[nt][e] = pe;
          rsum[e >> 1] += pe;
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * alpha[i] + rsum[i];
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
      }

      // O += P V.
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) {
        uint32_t a[4];
        a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int kvr = wc * BNW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vs + kvr * LD + dp * 16 + ((lane >> 4) << 3));
          mma_16816<T>(o[2 * dp], a, b[0], b[1]);
          mma_16816<T>(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // all warps are done with sK/sV: the epilogue overlays them

    // 5. Epilogue: per-warp (m, l, unnormalized O) -> smem, then combine and store.
    if (warp_active) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
      }
      const int r0 = wc * BM + wr * 16 + (lane >> 2), r1 = r0 + 8;
      const int cb = (lane & 3) << 1;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<float2*>(sO + r0 * LDO + dt * 8 + cb) = make_float2(o[dt][0], o[dt][1]);
        *reinterpret_cast<float2*>(sO + r1 * LDO + dt * 8 + cb) = make_float2(o[dt][2], o[dt][3]);
      }
      if ((lane & 3) == 0) {
        sM[r0] = m_run[0];
        sL[r0] = l_run[0];
        sM[r1] = m_run[1];
        sL[r1] = l_run[1];
      }
    }
    __syncthreads();
    constexpr int C4 = D / 4;
    T* out = static_cast<T*>(p.out);
    for (int idx = tid; idx < BM * C4; idx += kAttnThreads) {
      const int row = idx / C4, c = (idx % C4) * 4, gm = m0 + row;
      if (gm >= rows) continue;
      float mmax = neg_inf();
#pragma unroll
      for (int w = 0; w < WN; ++w) mmax = fmaxf(mmax, sM[w * BM + row]);
      float lsum = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (mmax != neg_inf()) {
#pragma unroll
        for (int w = 0; w < WN; ++w) {
          const float f = fast_exp2(sM[w * BM + row] - mmax);
          lsum += f * sL[w * BM + row];
          const float4 ov = *reinterpret_cast<const float4*>(sO + (w * BM + row) * LDO + c);
          acc.x += f * ov.x;
          acc.y += f * ov.y;
          acc.z += f * ov.z;
          acc.w += f * ov.w;
        }
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      const int64_t orow = static_cast<int64_t>(rq.q_start + gm / g) * p.num_q_heads + h * g +
                           gm % g;
      if (to_out) {
        *reinterpret_cast<uint2*>(out + orow * D + c) =
            make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
      } else {
        const int64_t prow = orow * p.max_splits + split;
        *reinterpret_cast<float4*>(p.part_o + prow * D + c) =
            make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
        if (c == 0) p.part_lse[prow] = lsum > 0.f ? mmax + __log2f(lsum) : neg_inf();
      }
    }
    __syncthreads();  // smem is reused by the next item
  }
}

// Combines the KV-split partials of every (token, query head) row whose request was split.
// One warp per row.
template <typename T>
__global__ void __launch_bounds__(128) merge_kernel(const AttentionParams p) {
  static_assert(kAttnMaxSplits <= 64, "each lane holds two splits");
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row_id >= static_cast<int64_t>(p.num_tokens) * p.num_q_heads) return;
  const int token = static_cast<int>(row_id / p.num_q_heads);
  const int r = find_request(p, token);
  if (r < 0) return;
  const int kv_chunk = __ldg(p.split_chunk);
  const Request rq = load_request(p, r, kv_chunk);
  if (rq.num_splits <= 1) return;  // written directly by the attention kernel
  const int pos = rq.first_pos + (token - rq.q_start);
  // The splits [s0, s0 + nv) hold the row's window (the attention kernel wrote all of them).
  const int s0 = pos < 0 ? 0 : (window_start(p, pos) - rq.kv_start) / kv_chunk;
  const int nv = pos < 0 ? 0 : min(rq.num_splits, (pos - rq.kv_start) / kv_chunk + 1) - s0;
  const int64_t prow0 = row_id * p.max_splits + s0;
  // Splits s0 + lane and s0 + lane + 32 (kAttnMaxSplits <= 64).
  float lse0 = lane < nv ? p.part_lse[prow0 + lane] : neg_inf();
  float lse1 = lane + 32 < nv ? p.part_lse[prow0 + lane + 32] : neg_inf();
  const float mmax = warp_max(fmaxf(lse0, lse1));
  float w0 = 0.f, w1 = 0.f;
  if (mmax != neg_inf()) {
    w0 = fast_exp2(lse0 - mmax);
    w1 = fast_exp2(lse1 - mmax);
  }
  const float wsum = warp_sum(w0 + w1);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(p.out) + row_id * p.head_dim;
  // Every lane runs every iteration (the shuffles need the whole warp); lanes past head_dim
  // only skip the loads and stores.
  for (int c0 = 0; c0 < p.head_dim; c0 += 128) {
    const int c = c0 + lane * 4;
    const bool active = c < p.head_dim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < nv; ++s) {
      const float ws = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31);
      if (active) {
        const float4 v =
            *reinterpret_cast<const float4*>(p.part_o + (prow0 + s) * p.head_dim + c);
        acc.x += ws * v.x;
        acc.y += ws * v.y;
        acc.z += ws * v.z;
        acc.w += ws * v.w;
      }
    }
    if (active) {
      out[c] = from_float<T>(acc.x * inv);
      out[c + 1] = from_float<T>(acc.y * inv);
      out[c + 2] = from_float<T>(acc.z * inv);
      out[c + 3] = from_float<T>(acc.w * inv);
    }
  }
}

// ---- simple CUDA-core kernel (fp32, head dims without a tensor-core kernel) ------------------
// One warp per (token, query head) row; lane j holds dims j, j + 32, ... (head_dim <= 256).
template <typename T, typename KV = T>
__global__ void __launch_bounds__(128) attention_simple_kernel(const AttentionParams p) {
  constexpr int kMaxPerLane = 8;
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row_id >= static_cast<int64_t>(p.num_tokens) * p.num_q_heads) return;
  const int token = static_cast<int>(row_id / p.num_q_heads);
  const int hq = static_cast<int>(row_id % p.num_q_heads);
  const int g = p.num_q_heads / p.num_kv_heads, h = hq / g, D = p.head_dim;
  const int r = find_request(p, token);
  if (r < 0) return;
  const Request rq = load_request(p, r, max(p.max_context, 1));  // one split
  const int pos = rq.first_pos + (token - rq.q_start);
  const int kv_end = min(pos + 1, rq.ctx);
  const T* qrow = static_cast<const T*>(p.q) + static_cast<int64_t>(token) * p.q_stride_token +
                  static_cast<int64_t>(hq) * p.q_stride_head;
  float qv[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < D ? to_float<T>(qrow[d]) * p.scale_log2 : 0.f;
    acc[j] = 0.f;
  }
  const KV* kc = static_cast<const KV*>(p.k_cache);
  const KV* vc = static_cast<const KV*>(p.v_cache);
  const int32_t* blocks = p.block_table + static_cast<int64_t>(r) * p.max_blocks;
  float m = neg_inf(), l = 0.f;
  for (int kv = window_start(p, pos); kv < kv_end; ++kv) {
    const int blk = __ldg(blocks + kv / p.block_size);
    if (blk < 0 || blk >= p.num_blocks) continue;  // invalid block id: skipped
    const int64_t base =
        ((static_cast<int64_t>(blk) * p.block_size + kv % p.block_size) * p.num_kv_heads + h) * D;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < D) dot += qv[j] * to_float<KV>(kc[base + d]);
    }
    dot = warp_sum(dot);
    const float m_new = fmaxf(m, dot);
    const float alpha = exp2f(m - m_new), pe = exp2f(dot - m_new);
    l = l * alpha + pe;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int d = lane + 32 * j;
      acc[j] = acc[j] * alpha + (d < D ? pe * to_float<KV>(vc[base + d]) : 0.f);
    }
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(p.out) + row_id * D;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int d = lane + 32 * j;
    if (d < D) out[d] = from_float<T>(acc[j] * inv);
  }
}

}  // namespace orca::cuda::attn
