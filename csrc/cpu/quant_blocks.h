// The quantized linear's few-token work, shared by quantized_linear and the fused DecoderStack:
// its argument checks, the ISA choice, and one range of kSkinnyBlock-column blocks (dot products
// on the GGUF blocks, then the epilogue), so the two give the same results bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "checks.h"
#include "orca/cpu/quant_linear.h"
#include "skinny_blocks.h"

namespace orca {

// The most tokens kAvx512Vnni's int8 kernels take: beyond two, the per-token block scaling
// costs more than the integer dot products save (bench/quantized_linear.py).
constexpr int64_t kInt8MaxT = 2;

// 'q8_0', 'q4_0' or 'q4_1'; a RuntimeError naming `what` otherwise.
cpu::quant::Format parse_quant_format(c10::string_view name, const char* what = "format");

// The kernels' path: ORCA_QUANT_ISA (read at each call, so tests can switch it) where set, else
// the best this CPU runs.
cpu::quant::Isa chosen_quant_isa();

struct QuantArgs {
  cpu::quant::Format format;
  Activation act;
  InputNorm norm;
};

// quantized_linear's checks of its arguments: a RuntimeError naming the bad one.
QuantArgs check_quantized_linear_inputs(const at::Tensor& x, const at::Tensor& qweight,
                                        c10::string_view format, int64_t in_features,
                                        const std::optional<at::Tensor>& bias,
                                        c10::string_view activation,
                                        const std::optional<at::Tensor>& residual,
                                        c10::string_view norm,
                                        const std::optional<at::Tensor>& norm_weight,
                                        const std::optional<at::Tensor>& norm_bias,
                                        double norm_eps);

// Whether T tokens run kAvx512Vnni's int8 kernels (x rounded to int8 blocks first).
inline bool uses_int8_activations(cpu::quant::Isa isa, int64_t T) {
  return isa == cpu::quant::Isa::kAvx512Vnni && T <= kInt8MaxT;
}

// Blocks [begin, end) of kSkinnyBlock output columns of out [T, N] = act(x @ W^T + bias) +
// residual, W the GGUF blocks w ([N, K], or [2N, K] gate rows then up rows for silu_and_mul):
// each block's dot products on x (float32 [T, K]) or on x_int8 (its int8 blocks, where
// uses_int8_activations), up to kMaxDotTokens tokens at a time, then its epilogue. residual may
// be out; y_gate and y_up are scratch of T * kSkinnyBlock floats (y_up for silu_and_mul only).
template <typename scalar_t, Activation act>
void quant_dot_blocks(cpu::quant::Isa isa, cpu::quant::Format fmt, const float* x,
                      const uint8_t* x_int8, int64_t T, int64_t K, const uint8_t* w,
                      const scalar_t* bias, const scalar_t* residual, scalar_t* out, int64_t N,
                      int64_t begin, int64_t end, float* y_gate, float* y_up) {
  constexpr int64_t B = kSkinnyBlock, kChunk = cpu::quant::kMaxDotTokens;
  const int64_t row_bytes = K / cpu::quant::kBlockSize * cpu::quant::block_bytes(fmt);
  const int64_t half = act == Activation::kSiluAndMul ? N : 0;  // offset of the up rows
  float* const y[2] = {y_gate, y_up};
  for (int64_t blk = begin; blk < end; ++blk) {
    const int64_t n0 = blk * B, cols = std::min(B, N - n0);
    for (int64_t part = 0; part < (half ? 2 : 1); ++part) {
      const uint8_t* rows = w + (part * half + n0) * row_bytes;
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t tokens = std::min(kChunk, T - t0);
        if (x_int8) {
          cpu::quant::dot_rows_int8(fmt, x_int8 + cpu::quant::int8_activation_bytes(t0, K),
                                    tokens, K, rows, cols, y[part] + t0 * B, B);
        } else {
          cpu::quant::dot_rows(isa, fmt, x + t0 * K, tokens, K, rows, cols, y[part] + t0 * B, B);
        }
      }
    }
    epilogue<act, float, scalar_t>(y[0], half ? y[1] : nullptr, B, T, cols,
                                   bias ? bias + n0 : nullptr,
                                   bias && half ? bias + half + n0 : nullptr,
                                   residual ? residual + n0 : nullptr, out + n0, N);
  }
}

}  // namespace orca
