// The quantized linear's kernels for each ISA behind one set of entry points (quant_linear.h).
// Built without -march=native (its own object library): the portable path stays baseline code
// and the AVX2 / AVX-512 paths come only from their target regions, so a build runs on any
// x86-64 CPU and picks its path at run time.
#include "orca/cpu/quant_linear.h"

#include <cstdlib>

// GCC 12 warns that the AVX-512 intrinsics' own _mm512_undefined_* placeholders are used
// uninitialized when they are inlined into target-pragma code (its bug 105593, a false positive):
// off for the intrinsic headers, parsed here first.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "orca/cpu/dispatch_tokens.h"
#include "orca/cpu/quant_avx2.h"
#include "orca/cpu/quant_amx.h"
#include "orca/cpu/quant_avx512.h"
#include "orca/cpu/quant_int16.h"
#include "orca/cpu/quant_portable.h"
#include "orca/cpu/quant_vnni.h"
#include "orca/cpu/quant_vnni_rows16.h"

namespace orca::cpu::quant {

bool isa_supported(Isa isa) {
  __builtin_cpu_init();  // idempotent: the feature bits are valid even before libgcc set them
  switch (isa) {
    case Isa::kAmxInt8:
      return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
             isa_supported(Isa::kAvx512Vnni) && cpu::amx::tile_data_granted();
    case Isa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni") && isa_supported(Isa::kAvx512);
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             isa_supported(Isa::kAvx2);
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return true;
  }
}

Isa best_isa() {
  static const Isa best = isa_supported(Isa::kAmxInt8)      ? Isa::kAmxInt8
                          : isa_supported(Isa::kAvx512Vnni) ? Isa::kAvx512Vnni
                          : isa_supported(Isa::kAvx512)   ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kPortable;
  return best;
}

void dot_rows(Isa isa, Format format, const float* x, int64_t T, int64_t K, const uint8_t* w,
              int64_t rows, float* y, int64_t y_stride) {
  dispatch_format(format, [&]<Format F>() {
    dispatch_tokens(T, [&]<int kT>() {
      switch (isa) {
        // avx512_vnni and amx_int8 run AVX-512's float kernels for float activations.
        case Isa::kAvx512:
        case Isa::kAvx512Vnni:
        case Isa::kAmxInt8: return avx512::dot_rows<F, kT>(x, K, w, rows, y, y_stride);
        case Isa::kAvx2: return avx2::dot_rows<F, kT>(x, K, w, rows, y, y_stride);
        default: return portable::dot_rows<F, kT>(x, K, w, rows, y, y_stride);
      }
    });
  });
}

int64_t int8_activation_bytes(int64_t T, int64_t K) {
  return T * ((K / kBlockSize + 1) / 2) * static_cast<int64_t>(sizeof(vnni::BlockPair));
}

void quantize_activations(Format format, const float* x, int64_t T, int64_t K, void* x_int8) {
  vnni::quantize_activations(format, x, T, K, static_cast<vnni::BlockPair*>(x_int8));
}

void quantize_activations_fine(Format format, const float* x, int64_t T, int64_t K,
                               void* x_int8) {
  vnni::quantize_activations_fine(format, x, T, K, static_cast<vnni::BlockPair*>(x_int8));
}

void dot_rows_int8(Format format, const void* x_int8, int64_t T, int64_t K, const uint8_t* w,
                   int64_t rows, float* y, int64_t y_stride) {
  const auto* x = static_cast<const vnni::BlockPair*>(x_int8);
  dispatch_format(format, [&]<Format F>() {
    dispatch_tokens(T, [&]<int kT>() { vnni::dot_rows<F, kT>(x, K, w, rows, y, y_stride); });
  });
}

void dot_rows16_int8(Format format, const void* x_int8, int64_t T, int64_t K, const uint8_t* w,
                     int64_t rows, float* y, int64_t y_stride) {
  const auto* x = static_cast<const vnni::BlockPair*>(x_int8);
  dispatch_format(format, [&]<Format F>() {
    dispatch_tokens(T, [&]<int kT>() { vnni::dot_rows16<F, kT>(x, K, w, rows, y, y_stride); });
  });
}

int64_t amx_group_tokens(int64_t T) { return amx::group_tokens(T); }

int64_t amx_activation_bytes(int64_t T, int64_t K) {
  return amx::token_groups(T) * amx::group_bytes(amx::group_tokens(T), K);
}

void quantize_activations_amx(const float* x, int64_t T, int64_t K, int64_t G, void* x_amx) {
  amx::quantize_activations(x, T, K, G, static_cast<uint8_t*>(x_amx));
}

void dot_rows_amx(Format format, const void* x_amx, int64_t T, int64_t K, const uint8_t* w,
                  bool rows16, int64_t rows, float* y, int64_t y_stride) {
  const auto* x = static_cast<const uint8_t*>(x_amx);
  dispatch_format(format,
                  [&]<Format F>() { amx::dot_rows<F>(x, T, K, w, rows16, rows, y, y_stride); });
}

int64_t int16_tiles(int64_t T) { return int16::tiles(T); }

int64_t int16_activation_bytes(int64_t T, int64_t K) {
  return int16::tiles(T) * int16::tile_bytes(K);
}

void quantize_activations_int16(const float* x, int64_t T, int64_t K, int64_t begin,
                                int64_t end, void* x_int16) {
  auto* out = static_cast<uint8_t*>(x_int16);
  for (int64_t tile = begin; tile < end; ++tile) {
    int16::quantize_tile(x, T, K, tile, out + tile * int16::tile_bytes(K));
  }
}

int64_t int16_group_weights(Format format) { return int16::group_weights(format); }

int64_t int16_padded_rows(int64_t rows) { return int16::padded_rows(rows); }

void unpack_rows_int16(Format format, const uint8_t* w, bool rows16, int64_t K, int64_t rows,
                       int16_t* quants, float* scales, float* offsets) {
  dispatch_format(format, [&]<Format F>() {
    const int64_t padded = int16::padded_rows(rows);
    if (rows16) return int16::unpack_rows16<F>(w, K, rows, padded, quants, scales, offsets);
    int16::unpack_rows<F>(w, K, rows, padded, quants, scales, offsets);
  });
}

void gemm_rows_int16(Format format, const void* x_int16, int64_t T, int64_t K,
                     const int16_t* quants, const float* scales, const float* offsets,
                     int64_t rows, float* y, int64_t y_stride) {
  const auto* x = static_cast<const uint8_t*>(x_int16);
  dispatch_format(format, [&]<Format F>() {
    int16::gemm_rows<F>(x, T, K, quants, scales, offsets, rows, y, y_stride);
  });
}

namespace {

template <typename out_t>
void dequantize_any(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                    out_t* out) {
  dispatch_format(format, [&]<Format F>() {
    switch (isa) {
      case Isa::kAvx512:
      case Isa::kAvx512Vnni:
      case Isa::kAmxInt8: return avx512::dequantize_rows<F>(w, K, rows, out);
      case Isa::kAvx2: return avx2::dequantize_rows<F>(w, K, rows, out);
      default: return portable::dequantize_rows<F>(w, K, rows, out);
    }
  });
}

}  // namespace

void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     float* out) {
  dequantize_any(isa, format, w, K, rows, out);
}

void dequantize_rows(Isa isa, Format format, const uint8_t* w, int64_t K, int64_t rows,
                     uint16_t* out) {
  dequantize_any(isa, format, w, K, rows, out);
}

}  // namespace orca::cpu::quant
