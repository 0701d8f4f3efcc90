// The quantized linear's few-token work, shared by quantized_linear and the fused DecoderStack:
// its argument checks, the ISA choice, and one range of kRowGroup-column groups (dot products
// on the GGUF blocks, then the epilogue), so the two give the same results bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checks.h"
#include "isa_choice.h"
#include "orca/cpu/quant_linear.h"
#include "orca/cpu/quant_rows16.h"
#include "skinny_blocks.h"

namespace orca {

// The most tokens kAvx512Vnni's int8 kernels take: beyond two, the per-token block scaling
// costs more than the integer dot products save (bench/quantized_linear.py).
constexpr int64_t kInt8MaxT = 2;
// The most tokens they take on the x16 layout, whose scaling is per 16 rows, in passes of
// kMaxDotTokens: up to where quantized_linear's int16 GEMM (on rows de-interleaved) overtakes.
constexpr int64_t kRows16Int8MaxT = 24;
// On kAmxInt8 the tiles overtake them beyond one pass (bench/quantized_linear.py).
constexpr int64_t kRows16AmxMaxT = cpu::quant::kMaxDotTokens;

// How a call's activations reach the dot kernels: as float32; split into two int8 parts per
// block for the VNNI kernels (kAvx512Vnni and kAmxInt8, up to kInt8MaxT tokens, kRows16Int8MaxT
// or kRows16AmxMaxT on the x16 layout, where the call allows int8 rounding; within
// max |x| / 65024 of each block); on the x16 layout, where the call refuses int8 rounding (the
// output heads), for up to half those tokens, split so and their remainder split again
// (kVnniFine, as fine as float32: quantize_activations_fine; twice the tokens for the kernels);
// or split in two int8 parts in the tiles' layout for kAmxInt8's tile kernels (more tokens;
// within max |x| / 64516 of each block, finer than bfloat16, so taken whether or not the call
// allows int8 rounding).
enum class Int8Path { kNone, kVnni, kVnniFine, kAmx };

// The format named 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q4_K', 'q5_K' or 'q6_K' (ggml's
// type names) or 'q8_m' (orca's); a RuntimeError naming `what` otherwise.
cpu::quant::Format parse_quant_format(c10::string_view name, const char* what = "format");

// A weight's blocks: their format, and whether its rows are in the x16 layout
// (orca/cpu/quant_rows16.h), named by the format's name with kRows16Suffix.
struct QuantLayout {
  cpu::quant::Format format;
  bool rows16;
};
constexpr const char* kRows16Suffix = "_x16";

// parse_quant_format, or a format with the x16 layout ('q5_0_x16'); a RuntimeError naming
// `what` otherwise.
QuantLayout parse_quant_layout(c10::string_view name, const char* what = "format");

// qweight's rows checked as GGUF blocks of fmt (named `format`) holding K weights each (K
// named k_name): K a non-negative multiple of the format's block, and qweight's bytes per row
// those K take; a RuntimeError naming the bad one.
void check_block_rows(const at::Tensor& qweight, cpu::quant::Format fmt,
                      c10::string_view format, int64_t K, const char* k_name);

// qweight in the x16 layout (named `format`) checked to have a multiple of kRowGroup rows (in
// each of its gate and up halves if gated); a RuntimeError otherwise.
void check_rows16_rows(const at::Tensor& qweight, c10::string_view format, bool gated);

struct QuantArgs {
  QuantLayout layout;
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

// The path of T tokens of the format on the ISA (allow_int8: whether the call allows int8
// rounding): amx_int8's tiles beyond the int8 dot kernels' tokens (where the call refuses int8
// rounding on the x16 layout: beyond kVnniFine's); avx512_vnni runs q8_0's 1-2 token steps on
// the float kernels in the row layout: its int8 kernel there is compute-bound below the float
// kernel's memory rate on weights streamed from DRAM (the x16 layout's is not).
inline Int8Path int8_path(cpu::quant::Isa isa, QuantLayout layout, int64_t T, bool allow_int8) {
  using cpu::quant::Isa;
  const int64_t vnni_max_t = !layout.rows16         ? kInt8MaxT
                            : isa == Isa::kAmxInt8 ? kRows16AmxMaxT
                                                   : kRows16Int8MaxT;
  const bool int8_isa = isa == Isa::kAvx512Vnni || isa == Isa::kAmxInt8;
  if (layout.rows16 && int8_isa && !allow_int8) {
    return 2 * T <= vnni_max_t ? Int8Path::kVnniFine
           : isa == Isa::kAmxInt8 ? Int8Path::kAmx
                                  : Int8Path::kNone;
  }
  if (T <= vnni_max_t) {
    const bool q8_0_rows = layout.format == cpu::quant::Format::kQ8_0 && !layout.rows16;
    const bool vnni = (isa == Isa::kAvx512Vnni && !q8_0_rows) || isa == Isa::kAmxInt8;
    return vnni && allow_int8 ? Int8Path::kVnni : Int8Path::kNone;
  }
  return isa == Isa::kAmxInt8 ? Int8Path::kAmx : Int8Path::kNone;
}

// Rows [0, rows) of w in the file's row layout: w itself, or w's x16 rows (rows a multiple of
// kRowGroup) de-interleaved into scratch, for the kernels without an x16 form.
inline const uint8_t* file_rows(QuantLayout layout, const uint8_t* w, int64_t K, int64_t rows,
                                std::vector<uint8_t>& scratch) {
  if (!layout.rows16) return w;
  scratch.resize(rows * cpu::quant::row_bytes(layout.format, K));
  cpu::quant::convert_rows16<false>(layout.format, w, K, rows, scratch.data());
  return scratch.data();
}

// The bytes of x_int8 for T tokens of K values on the path.
inline int64_t int8_bytes(Int8Path path, int64_t T, int64_t K) {
  return path == Int8Path::kVnni       ? cpu::quant::int8_activation_bytes(T, K)
         : path == Int8Path::kVnniFine ? cpu::quant::int8_activation_bytes(2 * T, K)
         : path == Int8Path::kAmx      ? cpu::quant::amx_activation_bytes(T, K)
                                       : 0;
}

// x (float32 [T, K]) rounded into x_int8 for the path (nothing for kNone).
inline void quantize_for(Int8Path path, cpu::quant::Format fmt, const float* x, int64_t T,
                         int64_t K, uint8_t* x_int8) {
  if (path == Int8Path::kVnni) cpu::quant::quantize_activations(fmt, x, T, K, x_int8);
  if (path == Int8Path::kVnniFine) cpu::quant::quantize_activations_fine(fmt, x, T, K, x_int8);
  if (path == Int8Path::kAmx) {
    cpu::quant::quantize_activations_amx(x, T, K, cpu::quant::amx_group_tokens(T), x_int8);
  }
}

// The threads' shares of a quantized linear's N output columns: groups of kRowGroup columns
// (ceil(N / kRowGroup) of them, split by at::parallel_for with this grain), so that the shares
// differ by at most one group (blocks of kSkinnyBlock columns would split SmolLM2's 576 as 5
// blocks against 4).
inline int64_t quant_group_grain(int64_t K, Activation act) {
  static_assert(kSkinnyBlock % cpu::quant::kRowGroup == 0);
  return skinny_grain(K, act) * (kSkinnyBlock / cpu::quant::kRowGroup);
}

// Groups [begin, end) of kRowGroup output columns of out [T, N] = act(x @ W^T + bias) +
// residual, W the GGUF blocks w ([N, K], or [2N, K] gate rows then up rows for gated acts;
// N a multiple of kRowGroup in the x16 layout), in blocks of up to kSkinnyBlock columns: each
// block's dot products on x (float32 [T, K], up to kMaxDotTokens tokens at a time) or on x_int8
// (quantize_for's rounding of x for `path`), then its epilogue. residual may be out; y_gate and
// y_up are scratch of T * kSkinnyBlock floats (y_up for gated acts only).
template <typename scalar_t, Activation act>
void quant_dot_groups(cpu::quant::Isa isa, QuantLayout layout, const float* x, Int8Path path,
                      const uint8_t* x_int8, int64_t T, int64_t K, const uint8_t* w,
                      const scalar_t* bias, const scalar_t* residual, scalar_t* out, int64_t N,
                      int64_t begin, int64_t end, float* y_gate, float* y_up) {
  constexpr int64_t B = kSkinnyBlock, kChunk = cpu::quant::kMaxDotTokens;
  const cpu::quant::Format fmt = layout.format;
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, K);
  const int64_t half = is_gated(act) ? N : 0;  // offset of the up rows
  const int64_t last = std::min(N, end * cpu::quant::kRowGroup);
  float* const y[2] = {y_gate, y_up};
  thread_local std::vector<uint8_t> scratch;
  for (int64_t n0 = begin * cpu::quant::kRowGroup; n0 < last; n0 += B) {
    const int64_t cols = std::min(B, last - n0);
    for (int64_t part = 0; part < (half ? 2 : 1); ++part) {
      const uint8_t* rows = w + (part * half + n0) * row_bytes;
      if (layout.rows16 && path == Int8Path::kVnni) {
        for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
          cpu::quant::dot_rows16_int8(fmt, x_int8 + cpu::quant::int8_activation_bytes(t0, K),
                                      std::min(kChunk, T - t0), K, rows, cols, y[part] + t0 * B,
                                      B);
        }
        continue;
      }
      if (path == Int8Path::kVnniFine) {
        // Each token's two rows of products (its split, its remainder's) summed, kChunk rows
        // a pass.
        float pairs[kChunk * B];
        for (int64_t t0 = 0; t0 < 2 * T; t0 += kChunk) {
          const int64_t count = std::min(kChunk, 2 * T - t0);
          cpu::quant::dot_rows16_int8(fmt, x_int8 + cpu::quant::int8_activation_bytes(t0, K),
                                      count, K, rows, cols, pairs, B);
          for (int64_t t = 0; t < count / 2; ++t) {
            for (int64_t c = 0; c < cols; ++c) {
              y[part][(t0 / 2 + t) * B + c] = pairs[2 * t * B + c] + pairs[(2 * t + 1) * B + c];
            }
          }
        }
        continue;
      }
      if (path == Int8Path::kAmx) {
        cpu::quant::dot_rows_amx(fmt, x_int8, T, K, rows, layout.rows16, cols, y[part], B);
        continue;
      }
      rows = file_rows(layout, rows, K, cols, scratch);
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t tokens = std::min(kChunk, T - t0);
        if (path == Int8Path::kVnni) {
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
