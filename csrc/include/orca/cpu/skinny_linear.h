// Torch-free dot-product kernel for linear layers with very few tokens (decode at small
// batch): y[t, n] = x[t, :] . w[n, :]. Each weight row is read once, front to back, for all kT
// tokens, and a thread walks kStreams distant row ranges side by side: long sequential
// streams, prefetched ahead, with each x load shared by all of them, draw more memory
// bandwidth than one stream or a few adjacent rows interleaved (short streams the hardware
// prefetcher follows badly). The software prefetch runs far ahead into L2 (prefetcht1; as far
// into L1 it left the FMAs fewer loads in flight), and a few lines ahead from L2 into L1
// (prefetcht0). BLAS GEMM kernels are tuned for many rows and lose much of the bandwidth here.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "orca/cpu/vec.h"

namespace orca::cpu {

// How far ahead of its reads each weight stream is prefetched: far enough to cover the memory
// latency, not so far that the lines are evicted before use. With 4 streams per thread (from
// 2 tokens) 3 KB, with 2 (one token) 2 KB: the distances that streamed orca-tiny's linears
// fastest; shorter ones stalled on memory and longer ones gained nothing.
constexpr int64_t kSkinnyPrefetchBytes = 2048;
template <int kT>
constexpr int64_t skinny_prefetch_bytes() {
  return kT >= 2 ? 3072 : kSkinnyPrefetchBytes;
}
// Each line is also asked into L1 (prefetcht0) this far ahead of its load, from L2 where the
// far prefetch put it, so the FMAs' loads hit L1; this helps most at few tokens (most of all
// the bfloat16 kernel at one token), where there is least arithmetic to hide an L2 latency.
constexpr int64_t kSkinnyL1PrefetchBytes = 512;

// Both prefetches of a weight stream at `at`: far_bytes ahead into L2, the near one into L1.
inline void prefetch_weights(const void* at, int64_t far_bytes) {
  const char* bytes = static_cast<const char*>(at);
  __builtin_prefetch(bytes + far_bytes, 0, 2);
  __builtin_prefetch(bytes + kSkinnyL1PrefetchBytes, 0, 3);
}

// sums[s * kT + t] = the lane sum of acc[s][t] (its kChains chains added): 16 accumulators at a
// time in one shuffle tree (hsum16), which shares the shuffles among them; fewer are folded one
// at a time, where a tree would have nothing to share. sums holds
// lane_sums_size(kStreams * kT) floats.
constexpr int lane_sums_size(int sums) { return (sums + 15) / 16 * 16; }
template <int kStreams, int kT, int kChains, typename V>
inline void lane_sums(const V (&acc)[kStreams][kT][kChains], float* sums) {
  constexpr int kSums = kStreams * kT;
  const auto total = [&](int j) {
    const auto& chains = acc[j / kT][j % kT];
    vec16 v = chains[0];
    for (int c = 1; c < kChains; ++c) v += chains[c];
    return v;
  };
  if constexpr (kSums >= 16) {
    for (int g = 0; g < kSums; g += 16) {
      vec16 totals[16] = {};
      for (int j = 0; j < std::min(16, kSums - g); ++j) totals[j] = total(g + j);
      store16(sums + g, hsum16(totals));
    }
  } else {
    for (int j = 0; j < kSums; ++j) sums[j] = hsum(total(j));
  }
}

// Rows first[s] + i of w: [N, K] (s < kStreams, i < rows) against x: [kT, K] float32; writes
// y[s][t * y_stride + i].
template <int kT, int kStreams, typename scalar_t>
void skinny_rows(const float* x, const scalar_t* w, int64_t K, const int64_t (&first)[kStreams],
                 int64_t rows, float* const (&y)[kStreams], int64_t y_stride) {
  // Independent FMA chains: enough accumulators in flight to cover the FMA latency.
  constexpr int kChains = kT * kStreams >= 4 ? 1 : 4 / (kT * kStreams);
  constexpr int64_t kStep = 16 * kChains;
  // From 6 tokens each token vector is pinned in a register too (else GCC folds its load into
  // every stream's FMA, one load per stream); with fewer tokens the folded loads cost less than
  // the extra instructions, so they stay folded.
  constexpr bool kPinTokens = kT >= 6;
  const int64_t k_main = K / kStep * kStep, k_vec = K / 16 * 16;
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* row[kStreams];
    for (int s = 0; s < kStreams; ++s) row[s] = w + (first[s] + i) * K;
    vec16 acc[kStreams][kT][kChains] = {};
    for (int64_t k = 0; k < k_main; k += kStep) {
      for (int c = 0; c < kChains; ++c) {
        vec16 wv[kStreams];
        for (int s = 0; s < kStreams; ++s) {
          const scalar_t* chunk = row[s] + k + 16 * c;
          prefetch_weights(chunk, skinny_prefetch_bytes<kT>());
          wv[s] = load16_as_float(chunk);
          keep_in_register(wv[s]);
        }
        for (int t = 0; t < kT; ++t) {
          vec16 xv = load16(x + t * K + k + 16 * c);
          if constexpr (kPinTokens) keep_in_register(xv);
          for (int s = 0; s < kStreams; ++s) acc[s][t][c] += wv[s] * xv;
        }
      }
    }
    for (int64_t k = k_main; k < k_vec; k += 16) {
      for (int s = 0; s < kStreams; ++s) {
        const vec16 wv = load16_as_float(row[s] + k);
        for (int t = 0; t < kT; ++t) acc[s][t][0] += wv * load16(x + t * K + k);
      }
    }
    float sums[lane_sums_size(kStreams * kT)];
    lane_sums(acc, sums);
    for (int s = 0; s < kStreams; ++s) {
      for (int t = 0; t < kT; ++t) {
        float sum = sums[s * kT + t];
        for (int64_t k = k_vec; k < K; ++k) sum += x[t * K + k] * static_cast<float>(row[s][k]);
        y[s][t * y_stride + i] = sum;
      }
    }
  }
}

#if defined(__AVX512BF16__)
// The same walk for bfloat16 weights and tokens (bit patterns, [N, K] and [kT, K]) on CPUs with
// AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 float lanes,
// so the weights need no widening (half the instructions of converting and FMA-ing in float).
template <int kT, int kStreams>
void skinny_rows_bf16(const uint16_t* x, const uint16_t* w, int64_t K,
                      const int64_t (&first)[kStreams], int64_t rows,
                      float* const (&y)[kStreams], int64_t y_stride) {
  constexpr int kChains = kT * kStreams >= 4 ? 1 : 4 / (kT * kStreams);
  constexpr int64_t kStep = 32 * kChains;
  const auto load = [](const uint16_t* p) {
    __m512bh v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  };
  const auto to_float = [](uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); };
  const int64_t k_main = K / kStep * kStep, k_vec = K / 32 * 32;
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row[kStreams];
    for (int s = 0; s < kStreams; ++s) row[s] = w + (first[s] + i) * K;
    __m512 acc[kStreams][kT][kChains];
    for (auto& per_stream : acc) {
      for (auto& per_token : per_stream) {
        for (auto& a : per_token) a = _mm512_setzero_ps();
      }
    }
    // 32 positions of every stream and token into chain c.
    const auto chunk = [&](int64_t k, int c) {
      __m512bh wv[kStreams];
      for (int s = 0; s < kStreams; ++s) {
        prefetch_weights(row[s] + k, kSkinnyPrefetchBytes);
        wv[s] = load(row[s] + k);
        keep_in_register(wv[s]);
      }
      for (int t = 0; t < kT; ++t) {
        const __m512bh xv = load(x + t * K + k);
        for (int s = 0; s < kStreams; ++s) {
          acc[s][t][c] = _mm512_dpbf16_ps(acc[s][t][c], wv[s], xv);
        }
      }
    };
    for (int64_t k = 0; k < k_main; k += kStep) {
      for (int c = 0; c < kChains; ++c) chunk(k + 32 * c, c);
    }
    for (int64_t k = k_main; k < k_vec; k += 32) chunk(k, 0);
    float sums[lane_sums_size(kStreams * kT)];
    lane_sums(acc, sums);
    for (int s = 0; s < kStreams; ++s) {
      for (int t = 0; t < kT; ++t) {
        float sum = sums[s * kT + t];
        for (int64_t k = k_vec; k < K; ++k) sum += to_float(x[t * K + k]) * to_float(row[s][k]);
        y[s][t * y_stride + i] = sum;
      }
    }
  }
}
#endif

}  // namespace orca::cpu
