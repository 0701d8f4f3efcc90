// The quantized linear's kernels, written once over a vector type: each ISA header
// (quant_portable.h, quant_avx2.h, quant_avx512.h) includes this file inside its own namespace
// and target region, after defining there a struct Vec with
//   V, kWidth (floats per V), kChainTarget (independent FMA chains that cover its latency),
//   rows_for(kT) (weight rows walked side by side), zero, load, store, store_bf16 (rounded to
//   nearest even, as float_to_bf16), add, fmadd, hsum, and
//   dequant<Format>(row, c, V (&w)[32 / kWidth]) (weights 32c to 32c + 31 of a row of blocks as
//   float32 vectors: a block of the 32-weight formats, a sub-block of the K-quants),
// after including quant_prefetch.h. Deliberately without an include guard: one copy per ISA
// namespace.

// Rows [0, kRows) of w (each row_bytes of blocks) against the kT float32 tokens x [kT, K]:
// y[t * y_stride + r] = x[t] . row r. Every chunk of 32 weights is dequantized in registers once
// and used by all tokens; a row's accumulators are split into chains to cover the FMA latency.
template <Format F, int kT, int kRows>
inline void dot_row_group(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                          float* y, int64_t y_stride) {
  using V = typename Vec::V;
  constexpr int kVec = kBlockSize / Vec::kWidth;
  constexpr int kChains = std::clamp(Vec::kChainTarget / (kT * kRows), 1, kVec);
  // The bytes of a row per chunk (a K-quant's chunks share their super-block's bytes).
  constexpr int64_t kChunkBytes = block_bytes(F) / (weights_per_block(F) / kBlockSize);
  V acc[kRows][kT][kChains];
  for (auto& per_row : acc) {
    for (auto& per_token : per_row) {
      for (auto& chain : per_token) chain = Vec::zero();
    }
  }
  const int64_t chunks = K / kBlockSize;
  for (int64_t b = 0; b < chunks; ++b) {
    V wv[kRows][kVec];
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* row = w + r * row_bytes;
      prefetch_weights_ahead(row + b * kChunkBytes);
      Vec::template dequant<F>(row, b, wv[r]);
    }
#pragma GCC unroll 32
    for (int c = 0; c < kVec; ++c) {
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        const V xv = Vec::load(x + t * K + b * kBlockSize + c * Vec::kWidth);
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r) {
          acc[r][t][c % kChains] = Vec::fmadd(wv[r][c], xv, acc[r][t][c % kChains]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kT; ++t) {
      V sum = acc[r][t][0];
      for (int c = 1; c < kChains; ++c) sum = Vec::add(sum, acc[r][t][c]);
      y[t * y_stride + r] = Vec::hsum(sum);
    }
  }
}

// `rows` rows of w against kT tokens: groups of Vec::rows_for(kT) rows, then single rows.
template <Format F, int kT>
void dot_rows(const float* x, int64_t K, const uint8_t* w, int64_t rows, float* y,
              int64_t y_stride) {
  constexpr int kRows = Vec::rows_for(kT);
  const int64_t row_bytes = quant::row_bytes(F, K);
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) {
    dot_row_group<F, kT, kRows>(x, K, w + i * row_bytes, row_bytes, y + i, y_stride);
  }
  for (; i < rows; ++i) {
    dot_row_group<F, kT, 1>(x, K, w + i * row_bytes, row_bytes, y + i, y_stride);
  }
}

// `rows` rows of w dequantized into out [rows, K], float32 or bfloat16 bits (uint16_t).
template <Format F, typename out_t>
void dequantize_rows(const uint8_t* w, int64_t K, int64_t rows, out_t* out) {
  constexpr int kVec = kBlockSize / Vec::kWidth;
  // The rows' blocks lie back to back (K a multiple of the block), so chunk b of them all is
  // chunk b of one long row.
  const int64_t chunks = rows * (K / kBlockSize);
  for (int64_t b = 0; b < chunks; ++b) {
    typename Vec::V wv[kVec];
    Vec::template dequant<F>(w, b, wv);
    for (int c = 0; c < kVec; ++c) {
      if constexpr (std::is_same_v<out_t, float>) {
        Vec::store(out + b * kBlockSize + c * Vec::kWidth, wv[c]);
      } else {
        Vec::store_bf16(out + b * kBlockSize + c * Vec::kWidth, wv[c]);
      }
    }
  }
}
