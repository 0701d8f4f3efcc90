// The skinny (few-token) linear's per-thread work, shared by packed_linear and the fused
// DecoderStack: dot products that stream each weight row once (orca/cpu/skinny_linear.h), in
// blocks of kSkinnyBlock output columns, each block's epilogue (bias, activation, residual)
// applied while it is in cache.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "bf16_dot.h"
#include "ceil_div.h"
#include "checks.h"
#include "orca/cpu/dispatch_tokens.h"
#include "orca/cpu/math.h"
#include "orca/cpu/skinny_linear.h"

namespace orca {

constexpr int64_t kSkinnyMaxT = 8;
constexpr int64_t kSkinnyBlock = 64;  // output columns per task of the skinny path
// Small layers stay on one thread: a fork-join costs more than it saves below ~256 KB of
// weights, and stalls badly when another process holds a core.
constexpr int64_t kMinParallelWeights = 1 << 16;

template <Activation act, bool kBias, bool kResidual, typename in_t, typename scalar_t,
          typename out_t>
void epilogue_rows(const in_t* in, const in_t* up_in, int64_t in_stride, int64_t rows,
                   int64_t cols, const scalar_t* bias, const scalar_t* up_bias,
                   const scalar_t* residual, out_t* out, int64_t out_stride) {
  const auto biased = [](const in_t* row, const scalar_t* b, int64_t j) {
    if constexpr (kBias) return static_cast<float>(row[j]) + static_cast<float>(b[j]);
    return static_cast<float>(row[j]);
  };
  for (int64_t i = 0; i < rows; ++i) {
    const in_t* t = in + i * in_stride;
    out_t* o = out + i * out_stride;
    const scalar_t* r = residual + i * out_stride;
    const auto plus_residual = [&](float v, int64_t j) {
      if constexpr (kResidual) return v + static_cast<float>(r[j]);
      return v;
    };
    if constexpr (is_gated(act)) {
      const in_t* u = up_in + i * in_stride;
      for (int64_t j = 0; j < cols; ++j) {
        const float g = biased(t, bias, j);
        const float a = act == Activation::kSiluAndMul ? cpu::silu(g) : cpu::gelu_tanh(g);
        o[j] = static_cast<out_t>(plus_residual(a * biased(u, up_bias, j), j));
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const float v = biased(t, bias, j);
        const float a = act == Activation::kGeluTanh ? cpu::gelu_tanh(v)
                        : act == Activation::kRelu   ? cpu::relu(v)
                                                     : v;
        o[j] = static_cast<out_t>(plus_residual(a, j));
      }
    }
  }
}

// out[i, j] = act(in[i, j] + bias[j]) + residual[i, j]; for a gated act, act(in + bias) *
// (up_in + up_bias) + residual (up_bias is set exactly when bias is; residual, where set, has
// out's layout; out is the dtype, or float32 for logits_linear). With and without a bias (or
// residual) are separate loops: from `bias ? bias[j] : 0` the vectorizer emits masked loads,
// and on Zen 4 a masked load from a null bias (all lanes off) takes a microcode assist per
// vector, which made the silu_and_mul pass after a bias-free GEMM (Llama's MLP) slower than the
// eager silu(gate) * up it replaces.
template <Activation act, typename in_t, typename scalar_t, typename out_t>
void epilogue(const in_t* in, const in_t* up_in, int64_t in_stride, int64_t rows,
              int64_t cols, const scalar_t* bias, const scalar_t* up_bias,
              const scalar_t* residual, out_t* out, int64_t out_stride) {
  const auto run = [&]<bool kBias, bool kResidual>() {
    epilogue_rows<act, kBias, kResidual>(in, up_in, in_stride, rows, cols, bias, up_bias,
                                         residual, out, out_stride);
  };
  if (bias) {
    residual ? run.template operator()<true, true>() : run.template operator()<true, false>();
  } else {
    residual ? run.template operator()<false, true>() : run.template operator()<false, false>();
  }
}

// Rows first[s] .. first[s] + rows of the weights against the kT tokens x (float32, or the
// bfloat16 tokens themselves for the kBf16Dot kernel), into y[s]: picks the header's kernel.
template <int kT, int kStreams, typename scalar_t>
void dot_rows(const void* x, const scalar_t* w, int64_t K, const int64_t (&first)[kStreams],
                 int64_t rows, float* const (&y)[kStreams], int64_t y_stride) {
#if defined(__AVX512BF16__)
  if constexpr (kBf16Dot<scalar_t>) {
    return cpu::skinny_rows_bf16<kT, kStreams>(static_cast<const uint16_t*>(x),
                                               reinterpret_cast<const uint16_t*>(w), K, first,
                                               rows, y, y_stride);
  }
#endif
  cpu::skinny_rows<kT, kStreams>(static_cast<const float*>(x), w, K, first, rows, y, y_stride);
}

// Blocks [begin, end) of a skinny linear's kSkinnyBlock-column blocks: out[:, cols] =
// act(x @ w[cols]^T + bias) + residual, x [kT, K] (float32, or the bfloat16 tokens themselves for
// the kBf16Dot kernel), w [N, K] (gated acts: [2N, K], gate rows then up rows), out and
// residual [kT, N] (out in the dtype, or float32 for logits_linear). A thread runs blocks from
// distant parts of its range side by side (one weight stream each), or a block's gate and up
// rows for a gated act. residual may be out.
template <int kT, typename scalar_t, Activation act, typename out_t>
void skinny_blocks(const void* x_ptr, const scalar_t* w, int64_t K, int64_t N,
                   const scalar_t* bias, const scalar_t* residual, out_t* out_ptr,
                   int64_t begin, int64_t end) {
  constexpr int64_t B = kSkinnyBlock;
  // From 2 tokens a thread walks 4 streams instead of 2, so each x load serves twice the rows.
  constexpr int kStreams = kT >= 2 ? 4 : 2;
  const int64_t half = is_gated(act) ? N : 0;  // offset of the up rows
  const auto cols_of = [&](int64_t blk) { return std::min(B, N - blk * B); };
  const auto finish = [&](int64_t blk, const float* y, const float* up) {
    const int64_t n0 = blk * B;
    epilogue<act, float, scalar_t>(y, up, B, kT, cols_of(blk), bias ? bias + n0 : nullptr,
                                   bias && half ? bias + half + n0 : nullptr,
                                   residual ? residual + n0 : nullptr, out_ptr + n0, N);
  };
  float y[kStreams][kT * B];
  if (half) {
    for (int64_t blk = begin; blk < end; ++blk) {
      dot_rows<kT, 2>(x_ptr, w, K, {blk * B, half + blk * B}, cols_of(blk), {y[0], y[1]}, B);
      finish(blk, y[0], y[1]);
    }
    return;
  }
  // Blocks begin + s * q + i for s < kStreams side by side; only the last block overall can
  // be short, and it comes last in its group.
  const int64_t q = (end - begin) / kStreams;
  for (int64_t i = 0; i < q; ++i) {
    int64_t blocks[kStreams], first[kStreams];
    float* ys[kStreams];
    for (int s = 0; s < kStreams; ++s) {
      blocks[s] = begin + s * q + i;
      first[s] = blocks[s] * B;
      ys[s] = y[s];
    }
    const int64_t rows = cols_of(blocks[kStreams - 1]);
    dot_rows<kT, kStreams>(x_ptr, w, K, first, rows, ys, B);
    for (int s = 0; rows < B && s < kStreams - 1; ++s) {
      dot_rows<kT, 1>(x_ptr, w, K, {first[s] + rows}, B - rows, {y[s] + rows}, B);
    }
    for (int s = 0; s < kStreams; ++s) finish(blocks[s], y[s], nullptr);
  }
  for (int64_t blk = begin + kStreams * q; blk < end; ++blk) {
    dot_rows<kT, 1>(x_ptr, w, K, {blk * B}, cols_of(blk), {y[0]}, B);
    finish(blk, y[0], nullptr);
  }
}

// f.template operator()<kT, a>() for T tokens (1 to kSkinnyMaxT) and the activation act.
template <typename F>
void dispatch_skinny(int64_t T, Activation act, const F& f) {
  cpu::dispatch_tokens(T, [&]<int kT>() {
    switch (act) {
      case Activation::kNone: return f.template operator()<kT, Activation::kNone>();
      case Activation::kGeluTanh: return f.template operator()<kT, Activation::kGeluTanh>();
      case Activation::kRelu: return f.template operator()<kT, Activation::kRelu>();
      case Activation::kSiluAndMul: return f.template operator()<kT, Activation::kSiluAndMul>();
      case Activation::kGeluTanhAndMul:
        return f.template operator()<kT, Activation::kGeluTanhAndMul>();
    }
  });
}

// The fewest blocks worth a thread of their own, for weights of K columns (K = 0, an empty
// product, counts as 1).
inline int64_t skinny_grain(int64_t K, Activation act) {
  return ceil_div(kMinParallelWeights, kSkinnyBlock * std::max<int64_t>(K, 1) *
                                           (is_gated(act) ? 2 : 1));
}

}  // namespace orca
