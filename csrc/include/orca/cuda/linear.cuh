// Torch-free CUDA kernels for packed_linear's epilogues:
//  - skinny_linear_kernel: the whole op for few tokens (T <= kSkinnyMaxT), a weight-streaming
//    GEMV-like kernel with bias and activation (including the gated act(gate) * up) fused, so
//    decode steps read each weight once and write the output once;
//  - bias_act_kernel / act_and_mul_kernel: elementwise epilogues after a cuBLASLt GEMM when
//    cuBLASLt's own epilogue cannot be used.
#pragma once

#include "orca/cuda/common.cuh"
#include "orca/cuda/params.h"

namespace orca::cuda::linear {

__device__ __forceinline__ float gelu_tanh(float x) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  return 0.5f * x * (1.f + tanhf(k0 * (x + k1 * x * x * x)));
}
__device__ __forceinline__ float relu(float x) { return x > 0.f ? x : 0.f; }
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

__device__ __forceinline__ float apply_act(float x, Act act) {
  switch (act) {
    case Act::kGeluTanh: return gelu_tanh(x);
    case Act::kRelu: return relu(x);
    default: return x;
  }
}

// A gated act's activation of the gate.
__device__ __forceinline__ float gate_act(float x, Act act) {
  return act == Act::kSiluAndMul ? silu(x) : gelu_tanh(x);
}

// Eight (or four, for fp32) elements of a 16-byte chunk as floats.
template <typename T>
struct Chunk {
  static constexpr int kN = 16 / sizeof(T);
  float v[kN];
  __device__ __forceinline__ void load(const T* src) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = to_float<T>(e[i]);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = 0.f;
  }
};

constexpr int kSkinnyThreads = 128;
constexpr int kSkinnyRows = 4;  // weight rows per CTA (4 outputs, or 2 gate/up output pairs)

// One CTA computes kSkinnyRows weight rows for all T (<= TT) tokens; its threads split K in
// 16-byte chunks, then reduce across the CTA. Requires K % (16 / sizeof(T)) == 0 and 16-byte
// aligned rows of x and weight.
template <typename T, int TT>
__global__ void __launch_bounds__(kSkinnyThreads) skinny_linear_kernel(const SkinnyLinearParams p) {
  constexpr int NR = kSkinnyRows, VEC = Chunk<T>::kN, NW = kSkinnyThreads / 32;
  __shared__ float red[NW][NR * TT];
  const bool glu = act_gated(p.act);
  const int64_t cols_per_cta = glu ? NR / 2 : NR;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * cols_per_cta;
  int64_t wrow[NR];
  bool wvalid[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int64_t col = n0 + (glu ? i % (NR / 2) : i);
    wvalid[i] = col < p.N;
    wrow[i] = glu ? col + (i >= NR / 2 ? p.N : 0) : col;
  }
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  float acc[NR][TT];
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[i][t] = 0.f;

  const int64_t nchunks = p.K / VEC;
#pragma unroll 2
  for (int64_t c = threadIdx.x; c < nchunks; c += kSkinnyThreads) {
    Chunk<T> wc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      if (wvalid[i]) wc[i].load(w + wrow[i] * p.w_stride + c * VEC);
      else wc[i].zero();
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < p.T) {
        Chunk<T> xc;
        xc.load(x + t * p.x_stride + c * VEC);
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[i][t] = fmaf(wc[i].v[e], xc.v[e], acc[i][t]);
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < NR; ++i)
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      const float v = warp_sum(acc[i][t]);
      if (lane == 0) red[warp][i * TT + t] = v;
    }
  __syncthreads();
  if (threadIdx.x >= (glu ? NR / 2 : NR) * TT) return;
  const int i = threadIdx.x / TT, t = threadIdx.x % TT;
  if (t >= p.T || n0 + i >= p.N) return;
  const T* bias = static_cast<const T*>(p.bias);
  // Full dot product of CTA row `row` (weight row `wrow`) plus its bias.
  auto total = [&](int row, int64_t w_row) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < NW; ++wi) s += red[wi][row * TT + t];
    if (bias != nullptr) s += to_float<T>(bias[w_row]);
    return s;
  };
  const int64_t col = n0 + i;
  const float y = glu ? gate_act(total(i, col), p.act) * total(i + NR / 2, p.N + col)
                      : apply_act(total(i, col), p.act);
  static_cast<T*>(p.out)[t * p.N + n0 + i] = from_float<T>(y);
}

// In-place y = act(y + bias) over [T, N].
template <typename T>
__global__ void bias_act_kernel(T* y, const T* bias, int64_t T_, int64_t N, Act act) {
  const int64_t n = T_ * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = to_float<T>(y[i]);
    if (bias != nullptr) v += to_float<T>(bias[i % N]);
    y[i] = from_float<T>(apply_act(v, act));
  }
}

// out[t, i] = act(y[t, i]) * y[t, I + i] for y [T, 2I] and a gated act; each thread handles a
// 16-byte chunk (VEC = 16 / sizeof(T), needs I % VEC == 0) or, with VEC = 1, one element.
template <typename T, int VEC>
__global__ void act_and_mul_kernel(const T* y, T* out, int64_t T_, int64_t I, Act act) {
  const int64_t per_row = I / VEC, n = T_ * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row, c = (i % per_row) * VEC;
    const T* g = y + t * 2 * I + c;
    T* o = out + t * I + c;
    if constexpr (VEC == 1) {
      o[0] = from_float<T>(gate_act(to_float<T>(g[0]), act) * to_float<T>(g[I]));
    } else {
      static_assert(VEC * sizeof(T) == 16, "VEC must fill 16 bytes");
      Chunk<T> gc, uc;
      gc.load(g);
      uc.load(g + I);
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < VEC; ++k) e[k] = from_float<T>(gate_act(gc.v[k], act) * uc.v[k]);
      *reinterpret_cast<uint4*>(o) = raw;
    }
  }
}

}  // namespace orca::cuda::linear
