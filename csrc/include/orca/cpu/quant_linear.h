// Torch-free entry points of the quantized linear's kernels (csrc/cpu/quant_kernels.cpp, built
// for the baseline target with the AVX2 and AVX-512 paths in target regions): the caller picks
// the ISA, normally best_isa(), and quantized_linear.cpp adds the threads and the epilogue.
#pragma once

#include <cstdint>
#include <utility>

#include "orca/cpu/quant_formats.h"

namespace orca::cpu::quant {

// kAvx512Vnni: kAvx512 with int8 activations for the dot kernels of a few tokens (quant_vnni.h);
// kAmxInt8: kAvx512Vnni with AMX-INT8 tile products for more, on the activations split into two
// int8 parts per block (quant_amx.h).
enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Vnni, kAmxInt8 };

// The paths by the names ORCA_QUANT_ISA takes.
inline constexpr std::pair<const char*, Isa> kIsaNames[] = {{"portable", Isa::kPortable},
                                                            {"avx2", Isa::kAvx2},
                                                            {"avx512", Isa::kAvx512},
                                                            {"avx512_vnni", Isa::kAvx512Vnni},
                                                            {"amx_int8", Isa::kAmxInt8}};

constexpr int64_t kMaxDotTokens = 8;  // dot_rows takes 1 to this many tokens at once

// Whether this CPU runs the path (portable: always; amx_int8 also needs the OS to grant the
// process AMX tile data, asked for once).
bool isa_supported(Isa isa);

// The fastest path this CPU runs.
Isa best_isa();

// y[t * y_stride + i] = x[t] . W[i] for t < T (1 to kMaxDotTokens) and i < rows, x float32
// [T, K], W the dequantized rows of w (row_bytes(format, K) each, K a multiple of
// weights_per_block(format)).
void dot_rows(Isa isa, Format format, const float* x, int64_t T, int64_t K, const uint8_t* w,
              int64_t rows, float* y, int64_t y_stride);

// kAvx512Vnni's dot kernels: the bytes of T tokens of K values rounded to int8 blocks, x as
// rounded (K a multiple of 32), and dot_rows on them (T from 1 to kMaxDotTokens; token t of
// x_int8 starts int8_activation_bytes(t, K) bytes in), for every format.
int64_t int8_activation_bytes(int64_t T, int64_t K);
void quantize_activations(Format format, const float* x, int64_t T, int64_t K, void* x_int8);
void dot_rows_int8(Format format, const void* x_int8, int64_t T, int64_t K, const uint8_t* w,
                   int64_t rows, float* y, int64_t y_stride);

// x [T, K] as 2T tokens for dot_rows16_int8 (x_int8 of int8_activation_bytes(2T, K) bytes):
// tokens 2t and 2t + 1 are x[t]'s two int8 parts and those of their remainder, so that the sum
// of their dot products is as fine as float32 (a call that refuses int8 rounding).
void quantize_activations_fine(Format format, const float* x, int64_t T, int64_t K,
                               void* x_int8);

// dot_rows_int8 on w in the x16 layout (quant_rows16.h; rows a multiple of kRowGroup).
void dot_rows16_int8(Format format, const void* x_int8, int64_t T, int64_t K, const uint8_t* w,
                     int64_t rows, float* y, int64_t y_stride);

// kAmxInt8's tile kernels: T tokens are split into two int8 parts per block, in groups of
// amx_group_tokens(T) tokens (4 to 16) laid out as the tiles read them. The bytes of T tokens;
// the first T tokens of x [T, K] (K a multiple of 32) split into groups of G
// (amx_activation_bytes(G, K) bytes each, the last one padded); all T tokens' dot products
// against `rows` rows of w (in the x16 layout if rows16: rows a multiple of kRowGroup) on the
// groups of amx_group_tokens(T), for every format.
int64_t amx_group_tokens(int64_t T);
int64_t amx_activation_bytes(int64_t T, int64_t K);
void quantize_activations_amx(const float* x, int64_t T, int64_t K, int64_t G, void* x_amx);
void dot_rows_amx(Format format, const void* x_amx, int64_t T, int64_t K, const uint8_t* w,
                  bool rows16, int64_t rows, float* y, int64_t y_stride);

// kAvx512Vnni's GEMM for more tokens (quant_int16.h): x [T, K] rounded to int16 per block in
// int16_tiles(T) tiles of 16 tokens (int16_activation_bytes(T, K) bytes; tiles [begin, end) per
// call, so that threads can share them); a panel of `rows` rows of w (in the x16 layout if
// rows16: rows a multiple of kRowGroup) unpacked into
// int16_padded_rows(rows) rows of quants [padded, K], scales [padded, K /
// int16_group_weights(format)] and offsets [padded, K / 32]; and all T tokens against the panel.
int64_t int16_tiles(int64_t T);
int64_t int16_activation_bytes(int64_t T, int64_t K);
void quantize_activations_int16(const float* x, int64_t T, int64_t K, int64_t begin,
                                int64_t end, void* x_int16);
int64_t int16_group_weights(Format format);
int64_t int16_padded_rows(int64_t rows);
void unpack_rows_int16(Format format, const uint8_t* w, bool rows16, int64_t K, int64_t rows,
                       int16_t* quants, float* scales, float* offsets);
void gemm_rows_int16(Format format, const void* x_int16, int64_t T, int64_t K,
                     const int16_t* quants, const float* scales, const float* offsets,
                     int64_t rows, float* y, int64_t y_stride);

// The rows of w dequantized into out [rows, K]: float32, or bfloat16 bits rounded to nearest even.
void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     float* out);
void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     uint16_t* out);

}  // namespace orca::cpu::quant
