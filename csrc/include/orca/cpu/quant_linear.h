// Torch-free entry points of the quantized linear's kernels (csrc/cpu/quant_kernels.cpp, built
// for the baseline target with the AVX2 and AVX-512 paths in target regions): the caller picks
// the ISA, normally best_isa(), and quantized_linear.cpp adds the threads and the epilogue.
#pragma once

#include <cstdint>
#include <utility>

#include "orca/cpu/quant_formats.h"

namespace orca::cpu::quant {

// kAvx512Vnni: kAvx512 with int8 activations for the dot kernels (quant_vnni.h).
enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Vnni };

// The paths by the names ORCA_QUANT_ISA takes.
inline constexpr std::pair<const char*, Isa> kIsaNames[] = {{"portable", Isa::kPortable},
                                                            {"avx2", Isa::kAvx2},
                                                            {"avx512", Isa::kAvx512},
                                                            {"avx512_vnni", Isa::kAvx512Vnni}};

constexpr int64_t kMaxDotTokens = 8;  // dot_rows takes 1 to this many tokens at once

// Whether this CPU runs the path (portable: always).
bool isa_supported(Isa isa);

// The fastest path this CPU runs.
Isa best_isa();

// y[t * y_stride + i] = x[t] . W[i] for t < T (1 to kMaxDotTokens) and i < rows, x float32
// [T, K], W the dequantized rows of w (K / 32 blocks each, K a multiple of 32).
void dot_rows(Isa isa, Format format, const float* x, int64_t T, int64_t K, const uint8_t* w,
              int64_t rows, float* y, int64_t y_stride);

// kAvx512Vnni's dot kernels: the bytes of T tokens of K values rounded to int8 blocks, x as
// rounded (K a multiple of 32), and dot_rows on them (T from 1 to kMaxDotTokens; token t of
// x_int8 starts int8_activation_bytes(t, K) bytes in).
int64_t int8_activation_bytes(int64_t T, int64_t K);
void quantize_activations(Format format, const float* x, int64_t T, int64_t K, void* x_int8);
void dot_rows_int8(Format format, const void* x_int8, int64_t T, int64_t K, const uint8_t* w,
                   int64_t rows, float* y, int64_t y_stride);

// The rows of w dequantized into out [rows, K]: float32, or bfloat16 bits rounded to nearest even.
void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     float* out);
void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     uint16_t* out);

}  // namespace orca::cpu::quant
