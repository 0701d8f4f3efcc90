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

constexpr int64_t kTileRows = 128;
constexpr int64_t kTileCols = 256;

template <typename scalar_t, Activation act>
void epilogue(const scalar_t* tile, const scalar_t* up_tile, int64_t rows, int64_t cols,
              const scalar_t* bias, const scalar_t* up_bias, scalar_t* out, int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* t = tile + i * cols;
    scalar_t* o = out + i * out_stride;
    if constexpr (act == Activation::kSiluAndMul) {
      const scalar_t* u = up_tile + i * cols;
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

template <typename scalar_t, Activation act>
void tiled_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                  at::Tensor& out) {
  const int64_t T = x.size(0), N = out.size(1);
  const int64_t half = act == Activation::kSiluAndMul ? N : 0;  // offset of the up rows
  // Few rows (decode): one row tile, and narrower column tiles so every thread gets work.
  const int64_t tile_rows = T <= 2 * kTileRows ? T : kTileRows;
  const int64_t row_tiles = (T + tile_rows - 1) / tile_rows;
  const int64_t want_tiles = 4 * at::get_num_threads();
  int64_t tile_cols = kTileCols;
  while (tile_cols > 32 && row_tiles * ((N + tile_cols - 1) / tile_cols) < want_tiles) {
    tile_cols /= 2;
  }
  const int64_t col_tiles = (N + tile_cols - 1) / tile_cols;
  const scalar_t* bias_ptr = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, row_tiles * col_tiles, 1, [&](int64_t begin, int64_t end) {
    const auto opts = x.options();
    at::Tensor buf = at::empty({tile_rows, tile_cols}, opts);
    at::Tensor up_buf = half ? at::empty({tile_rows, tile_cols}, opts) : at::Tensor();
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = (tile / col_tiles) * tile_rows, c0 = (tile % col_tiles) * tile_cols;
      const int64_t rows = std::min(tile_rows, T - r0), cols = std::min(tile_cols, N - c0);
      const at::Tensor xs = x.narrow(0, r0, rows);
      // Contiguous [rows, cols] views of the buffers, so the epilogue reads them densely.
      at::Tensor b = buf.view(-1).narrow(0, 0, rows * cols).view({rows, cols});
      at::mm_out(b, xs, weight.narrow(0, c0, cols).t());
      const scalar_t* up_ptr = nullptr;
      if (half) {
        at::Tensor u = up_buf.view(-1).narrow(0, 0, rows * cols).view({rows, cols});
        at::mm_out(u, xs, weight.narrow(0, half + c0, cols).t());
        up_ptr = u.data_ptr<scalar_t>();
      }
      epilogue<scalar_t, act>(b.data_ptr<scalar_t>(), up_ptr, rows, cols,
                              bias_ptr ? bias_ptr + c0 : nullptr,
                              bias_ptr && half ? bias_ptr + half + c0 : nullptr,
                              out_ptr + r0 * N + c0, N);
    }
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
        tiled_linear<scalar_t, Activation::kSiluAndMul>(x, weight, bias_ptr, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace orca
