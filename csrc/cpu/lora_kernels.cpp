// lora_linear's row kernels for each ISA (orca/cpu/lora.h). Built without -march=native, with
// the quantized kernels: the portable path stays baseline code and the AVX2 / AVX-512 paths come
// only from their target regions, picked at run time.
#include "orca/cpu/lora.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace orca::cpu::lora {
namespace {

namespace portable {

float dot(const float* x, const float* w, int64_t K) {
  float sum = 0.f;
  for (int64_t k = 0; k < K; ++k) sum += x[k] * w[k];
  return sum;
}

void axpy(float alpha, const float* w, int64_t N, float* y) {
  for (int64_t n = 0; n < N; ++n) y[n] += alpha * w[n];
}

}  // namespace portable

namespace avx2 {

__attribute__((target("avx2,fma"))) float dot(const float* x, const float* w, int64_t K) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), acc1);
  }
  for (; k + 8 <= K; k += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc0);
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float sum = _mm_cvtss_f32(s);
  for (; k < K; ++k) sum += x[k] * w[k];
  return sum;
}

__attribute__((target("avx2,fma"))) void axpy(float alpha, const float* w, int64_t N, float* y) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    _mm256_storeu_ps(y + n, _mm256_fmadd_ps(a, _mm256_loadu_ps(w + n), _mm256_loadu_ps(y + n)));
  }
  for (; n < N; ++n) y[n] += alpha * w[n];
}

}  // namespace avx2

namespace avx512 {

__attribute__((target("avx512f"))) float dot(const float* x, const float* w, int64_t K) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), acc1);
  }
  if (k + 16 <= K) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), acc0);
    k += 16;
  }
  if (k < K) {  // the tail under a mask: no scalar loop
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

__attribute__((target("avx512f"))) void axpy(float alpha, const float* w, int64_t N, float* y) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    _mm512_storeu_ps(y + n, _mm512_fmadd_ps(a, _mm512_loadu_ps(w + n), _mm512_loadu_ps(y + n)));
  }
  if (n < N) {
    const __mmask16 m = static_cast<__mmask16>((1u << (N - n)) - 1);
    _mm512_mask_storeu_ps(y + n, m, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, w + n),
                                                    _mm512_maskz_loadu_ps(m, y + n)));
  }
}

}  // namespace avx512

template <typename Dot, typename Axpy>
void row_delta(Dot dot, Axpy axpy, const float* x, int64_t K, const float* a, int64_t R,
               const float* b_t, int64_t ldb, int64_t N, float scale, float* shrink, float* y) {
  for (int64_t j = 0; j < R; ++j) shrink[j] = scale * dot(x, a + j * K, K);
  for (int64_t j = 0; j < R; ++j) {
    if (shrink[j] != 0.f) axpy(shrink[j], b_t + j * ldb, N, y);
  }
}

template <typename Dot, typename Axpy>
void rows_delta(Dot dot, Axpy axpy, const float* const* xs, int64_t n, int64_t K, const float* a,
                int64_t R, const float* b_t, int64_t ldb, int64_t N, float scale, float* shrink,
                float* const* ys) {
  for (int64_t j = 0; j < R; ++j) {
    for (int64_t i = 0; i < n; ++i) shrink[i * R + j] = scale * dot(xs[i], a + j * K, K);
  }
  for (int64_t j = 0; j < R; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      if (shrink[i * R + j] != 0.f) axpy(shrink[i * R + j], b_t + j * ldb, N, ys[i]);
    }
  }
}

}  // namespace

void add_rows_delta(Isa isa, const float* const* xs, int64_t n, int64_t K, const float* a,
                    int64_t R, const float* b_t, int64_t ldb, int64_t N, float scale,
                    float* shrink, float* const* ys) {
  switch (isa) {
    case Isa::kAvx512:
      return rows_delta(avx512::dot, avx512::axpy, xs, n, K, a, R, b_t, ldb, N, scale, shrink,
                        ys);
    case Isa::kAvx2:
      return rows_delta(avx2::dot, avx2::axpy, xs, n, K, a, R, b_t, ldb, N, scale, shrink, ys);
    default:
      return rows_delta(portable::dot, portable::axpy, xs, n, K, a, R, b_t, ldb, N, scale,
                        shrink, ys);
  }
}

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
}

Isa best_isa() {
  static const Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kPortable;
  return best;
}

void add_row_delta(Isa isa, const float* x, int64_t K, const float* a, int64_t R,
                   const float* b_t, int64_t ldb, int64_t N, float scale, float* shrink,
                   float* y) {
  switch (isa) {
    case Isa::kAvx512:
      return row_delta(avx512::dot, avx512::axpy, x, K, a, R, b_t, ldb, N, scale, shrink, y);
    case Isa::kAvx2:
      return row_delta(avx2::dot, avx2::axpy, x, K, a, R, b_t, ldb, N, scale, shrink, y);
    default:
      return row_delta(portable::dot, portable::axpy, x, K, a, R, b_t, ldb, N, scale, shrink,
                       y);
  }
}

}  // namespace orca::cpu::lora
