// packed_linear on CPU: y = act(x @ W^T + b) over packed tokens.
// Without an activation the bias rides in BLAS's beta term (one addmm call, like F.linear).
// With one, the output is computed in cache-sized tiles: each tile's GEMM writes a thread-local
// buffer and the epilogue (bias + activation, or silu(gate) * up) turns it into the final
// output while it is still in cache, so the output is written exactly once.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "orca/cpu/math.h"

namespace orca {
namespace {

constexpr int64_t kMaxTileRows = 512;
constexpr int64_t kTileBufferElems = 128 * 1024;  // per thread, ~half of a 1 MB L2 in float32

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out[i, j] = act(in[i, j] + bias[j]); for silu_and_mul, silu(in + bias) * (up_in + up_bias).
template <typename scalar_t, Activation act>
void epilogue(const scalar_t* in, const scalar_t* up_in, int64_t in_stride, int64_t rows,
              int64_t cols, const scalar_t* bias, const scalar_t* up_bias, scalar_t* out,
              int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* t = in + i * in_stride;
    scalar_t* o = out + i * out_stride;
    if constexpr (act == Activation::kSiluAndMul) {
      const scalar_t* u = up_in + i * in_stride;
      for (int64_t j = 0; j < cols; ++j) {
        const float g = static_cast<float>(t[j]) + (bias ? static_cast<float>(bias[j]) : 0.f);
        const float v = static_cast<float>(u[j]) + (up_bias ? static_cast<float>(up_bias[j]) : 0.f);
        o[j] = static_cast<scalar_t>(cpu::silu(g) * v);
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const float v = static_cast<float>(t[j]) + (bias ? static_cast<float>(bias[j]) : 0.f);
        o[j] = static_cast<scalar_t>(act == Activation::kGeluTanh ? cpu::gelu_tanh(v)
                                                                  : cpu::relu(v));
      }
    }
  }
}

// gelu_tanh / relu: the GEMM runs per output tile into a thread-local buffer and the epilogue
// writes the final values while the tile is in cache.
template <typename scalar_t, Activation act>
void tiled_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                  at::Tensor& out) {
  const int64_t T = x.size(0), N = out.size(1);
  // Each BLAS call re-packs its x rows and weight rows, so tiles are tall (all rows up to
  // kMaxTileRows) and as wide as keeps the buffers in L2; at least two tiles per thread.
  const int64_t row_tiles = ceil_div(T, kMaxTileRows);
  const int64_t tile_rows = ceil_div(T, row_tiles);
  int64_t tile_cols = std::clamp<int64_t>(kTileBufferElems / tile_rows / 16 * 16, 16, N);
  while (tile_cols > 32 && row_tiles * ceil_div(N, tile_cols) < 2 * at::get_num_threads()) {
    tile_cols = ceil_div(tile_cols, 32) * 16;
  }
  const int64_t col_tiles = ceil_div(N, tile_cols);
  const scalar_t* bias_ptr = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    const auto opts = x.options();
    at::Tensor buf = at::empty({tile_rows, tile_cols}, opts);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = (tile / col_tiles) * tile_rows, c0 = (tile % col_tiles) * tile_cols;
      const int64_t rows = std::min(tile_rows, T - r0), cols = std::min(tile_cols, N - c0);
      const at::Tensor xs = x.narrow(0, r0, rows);
      // Contiguous [rows, cols] views of the buffers, so the epilogue reads them densely.
      at::Tensor b = buf.view(-1).narrow(0, 0, rows * cols).view({rows, cols});
      at::mm_out(b, xs, weight.narrow(0, c0, cols).t());
      epilogue<scalar_t, act>(b.data_ptr<scalar_t>(), nullptr, cols, rows, cols,
                              bias_ptr ? bias_ptr + c0 : nullptr, nullptr, out_ptr + r0 * N + c0,
                              N);
    }
  });
}

// silu_and_mul: gate and up are different weight rows, so a tile would need two BLAS calls
// that each re-pack x; one multithreaded GEMM of [T, 2I] followed by a single fused pass that
// reads gate and up and writes the [T, I] output costs less.
template <typename scalar_t>
void gemm_silu_and_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                       at::Tensor& out) {
  const at::Tensor y = bias ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  const int64_t T = x.size(0), I = out.size(1);
  const scalar_t* y_ptr = y.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    epilogue<scalar_t, Activation::kSiluAndMul>(y_ptr + begin * 2 * I, y_ptr + begin * 2 * I + I,
                                                2 * I, end - begin, I, nullptr, nullptr,
                                                out_ptr + begin * I, I);
  });
}

at::Tensor packed_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const std::optional<at::Tensor>& bias_in,
                             c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_linear_inputs(x_in, weight_in, bias_in, act);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n_out = act == Activation::kSiluAndMul ? weight.size(0) / 2 : weight.size(0);
  if (act == Activation::kNone) {
    return bias_in ? at::addmm(*bias_in, x, weight.t()) : at::mm(x, weight.t());
  }
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0 || n_out == 0) return out;
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  const at::Tensor* bias_ptr = bias_in ? &bias : nullptr;
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "packed_linear", [&] {
    switch (act) {
      case Activation::kGeluTanh:
        tiled_linear<scalar_t, Activation::kGeluTanh>(x, weight, bias_ptr, out);
        break;
      case Activation::kRelu:
        tiled_linear<scalar_t, Activation::kRelu>(x, weight, bias_ptr, out);
        break;
      default:
        gemm_silu_and_mul<scalar_t>(x, weight, bias_ptr, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace orca
