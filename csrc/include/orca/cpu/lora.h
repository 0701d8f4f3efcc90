// Torch-free CPU kernels of lora_linear (csrc/cpu/lora_kernels.cpp): one row's low-rank delta,
// y += scale * (x @ A^T) @ B^T, with A [R, K] and B^T [R, N] held as float32 rows, for each ISA.
#pragma once

#include <cstdint>
#include <utility>

namespace orca::cpu::lora {

enum class Isa { kPortable, kAvx2, kAvx512 };

// The ORCA_LORA_ISA names, best last.
constexpr std::pair<const char*, Isa> kIsaNames[] = {
    {"portable", Isa::kPortable}, {"avx2", Isa::kAvx2}, {"avx512", Isa::kAvx512}};

bool isa_supported(Isa isa);
Isa best_isa();

// y[n] += sum_j (scale * dot(x, a[j, :])) * b_t[j * ldb + n] for one row and n < N: x [K],
// a [R, K], b_t R rows of ldb (>= N) floats (a column range of a wider B^T), y [N], all float32;
// shrink [R] is the caller's scratch.
void add_row_delta(Isa isa, const float* x, int64_t K, const float* a, int64_t R,
                   const float* b_t, int64_t ldb, int64_t N, float scale, float* shrink,
                   float* y);

// add_row_delta for n rows of one adapter at once (xs[i], ys[i]; shrink [n * R]): each row of A
// and of B^T is read once for all n rows (from L1 after the first), not once per row.
void add_rows_delta(Isa isa, const float* const* xs, int64_t n, int64_t K, const float* a,
                    int64_t R, const float* b_t, int64_t ldb, int64_t N, float scale,
                    float* shrink, float* const* ys);

}  // namespace orca::cpu::lora
