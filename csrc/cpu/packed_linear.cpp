// packed_linear on CPU: y = act(x @ W^T + b) over packed tokens.
// Up to kSkinnyMaxT tokens, a dot-product kernel streams the weights once with the epilogue
// fused; up to kLanesMaxT tokens (float32, and bfloat16 on AVX512-BF16), a kernel with the
// tokens as vector lanes does.
// Beyond that, float32 runs on oneDNN's inner product with the activation as its post-op
// (see onednn_linear). Otherwise, without an activation the bias rides in BLAS's beta term (one
// addmm call, like F.linear); with gelu_tanh / relu the output is computed in cache-sized
// tiles, each tile's GEMM writing a thread-local buffer that the epilogue turns into the final
// output while it is still in cache; silu_and_mul / gelu_tanh_and_mul is one GEMM plus one
// fused pass.
// logits_linear is packed_linear without bias or activation whose output is float32 for every
// input dtype: the same skinny and lanes kernels (which accumulate in float32) write float32,
// and beyond them a float32 GEMM runs on weight tiles widened to float32.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include "orca/cpu/lanes_linear.h"
#include "normalized_input.h"
#include "skinny_blocks.h"

namespace orca {
namespace {

constexpr int64_t kLanesMaxT = 32;
constexpr int64_t kMaxTileRows = 512;
constexpr int64_t kTileBufferElems = 128 * 1024;  // per thread, ~half of a 1 MB L2 in float32

// float32 x [T, K] @ weight^T + bias through oneDNN (torch's own `mkldnn::_linear_pointwise`,
// the op Inductor's CPU code calls), with `attr` ("none", "relu", "gelu") and `algorithm`
// ("tanh" for gelu_tanh) fused as its post-op: at orca-tiny's prefill shapes it is faster than
// MKL's sgemm (torch.addmm, which float32 matmuls use) and runs close to the cores' FMA peak.
// nullopt when the torch build has no oneDNN, or for K = 0 (an empty inner product oneDNN
// refuses).
std::optional<at::Tensor> onednn_linear(const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias,
                                        const char* attr, const char* algorithm) {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (!op || x.size(1) == 0) return std::nullopt;
  torch::jit::Stack stack{x, weight, bias, std::string(attr),
                          c10::List<std::optional<at::Scalar>>(), std::string(algorithm)};
  op->callBoxed(&stack);
  return stack[0].toTensor();
}

// Up to kSkinnyMaxT tokens (decode at small batch): skinny_blocks (skinny_blocks.h) across the
// threads.
template <int kT, typename scalar_t, Activation act, typename out_t = scalar_t>
void skinny_linear(const at::Tensor& x, const at::Tensor& weight, const scalar_t* bias,
                   const scalar_t* residual, at::Tensor& out) {
  const int64_t K = x.size(1), N = out.size(1);
  const at::Tensor xs = kBf16Dot<scalar_t> ? x : x.to(at::kFloat).contiguous();
  const void* x_ptr = xs.data_ptr();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  out_t* out_ptr = out.data_ptr<out_t>();
  at::parallel_for(0, ceil_div(N, kSkinnyBlock), skinny_grain(K, act),
                   [&](int64_t begin, int64_t end) {
    skinny_blocks<kT, scalar_t, act>(x_ptr, w, K, N, bias, residual, out_ptr, begin, end);
  });
}

// kSkinnyMaxT < T <= kLanesMaxT tokens (decode at moderate batch): the tokens as vector lanes
// (orca/cpu/lanes_linear.h), in blocks of output columns across the threads, each block
// transposed back to [tokens][columns] for the epilogue while it is in cache.
template <int kTV, typename scalar_t, Activation act, typename out_t = scalar_t>
void lanes_linear(const at::Tensor& x, const at::Tensor& weight, const scalar_t* bias,
                  const scalar_t* residual, at::Tensor& out) {
  constexpr int64_t B = kSkinnyBlock;
  constexpr int W = 16 * kTV;
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t half = is_gated(act) ? N : 0;  // offset of the up rows
  // x^T, zero-padded to W tokens: floats, or for kBf16Dot the tokens' bf16 pairs (K even).
  at::Tensor xt;
  if constexpr (kBf16Dot<scalar_t>) {
    xt = at::zeros({K / 2, W}, x.options().dtype(at::kInt));
    xt.narrow(1, 0, T).copy_(x.view(at::kInt).t());
  } else {
    xt = at::zeros({K, W}, x.options().dtype(at::kFloat));
    xt.narrow(1, 0, T).copy_(x.t());
  }
  const void* xt_ptr = xt.data_ptr();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  out_t* out_ptr = out.data_ptr<out_t>();
  at::parallel_for(0, ceil_div(N, B), skinny_grain(K, act), [&](int64_t begin, int64_t end) {
    float y[B * W], by_token[2][W * B];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * B, cols = std::min(B, N - n0);
      for (int part = 0; part < (half ? 2 : 1); ++part) {
        const scalar_t* rows = w + (part * half + n0) * K;
        if constexpr (kBf16Dot<scalar_t>) {
          cpu::lanes_rows<kTV>(static_cast<const uint32_t*>(xt_ptr),
                               reinterpret_cast<const uint16_t*>(rows), K, cols, y);
        } else {
          cpu::lanes_rows<kTV>(static_cast<const float*>(xt_ptr), rows, K, cols, y);
        }
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t c = 0; c < cols; ++c) by_token[part][t * B + c] = y[c * W + t];
        }
      }
      epilogue<act, float, scalar_t>(by_token[0], half ? by_token[1] : nullptr, B, T, cols,
                                     bias ? bias + n0 : nullptr,
                                     bias && half ? bias + half + n0 : nullptr,
                                     residual ? residual + n0 : nullptr, out_ptr + n0, N);
    }
  });
}

// gelu_tanh / relu: the GEMM runs per output tile into a thread-local buffer and the epilogue
// writes the final values while the tile is in cache.
template <typename scalar_t, Activation act>
void tiled_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                  const scalar_t* residual, at::Tensor& out) {
  const int64_t T = x.size(0), N = out.size(1);
  // Each BLAS call re-packs its x rows and weight rows, so tiles are tall (all rows up to
  // kMaxTileRows) and as wide as keeps the buffers in L2; at least two tiles per thread.
  const int64_t row_tiles = ceil_div(T, kMaxTileRows);
  const int64_t tile_rows = ceil_div(T, row_tiles);
  // Each tile is a single-threaded GEMM, so their number is a multiple of the threads (5 tiles
  // on 2 threads would leave a core idle for the last).
  const int64_t threads = at::get_num_threads();
  int64_t col_tiles = ceil_div(N, std::clamp<int64_t>(kTileBufferElems / tile_rows, 16, N));
  col_tiles = std::max(col_tiles, ceil_div(2 * threads, row_tiles));
  while (row_tiles * col_tiles % threads != 0) ++col_tiles;
  const int64_t tile_cols = ceil_div(ceil_div(N, col_tiles), 16) * 16;
  col_tiles = ceil_div(N, tile_cols);
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
      epilogue<act, scalar_t, scalar_t>(b.data_ptr<scalar_t>(), nullptr, cols, rows, cols,
                                        bias_ptr ? bias_ptr + c0 : nullptr, nullptr,
                                        residual ? residual + r0 * N + c0 : nullptr,
                                        out_ptr + r0 * N + c0, N);
    }
  });
}

// Gated acts: gate and up are different weight rows, so a tile would need two BLAS calls that
// each re-pack x; one multithreaded GEMM of [T, 2I] followed by a single fused pass that reads
// gate and up and writes the [T, I] output costs less.
template <typename scalar_t, Activation act>
void gemm_and_mul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                  const scalar_t* residual, at::Tensor& out) {
  std::optional<at::Tensor> y_onednn;
  if (x.scalar_type() == at::kFloat) {
    y_onednn = onednn_linear(x, weight, bias ? std::optional(*bias) : std::nullopt, "none", "");
  }
  const at::Tensor y = y_onednn ? *y_onednn
                       : bias   ? at::addmm(*bias, x, weight.t())
                                : at::mm(x, weight.t());
  const int64_t T = x.size(0), I = out.size(1);
  const scalar_t* y_ptr = y.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    epilogue<act, scalar_t, scalar_t>(
        y_ptr + begin * 2 * I, y_ptr + begin * 2 * I + I, 2 * I, end - begin, I, nullptr,
        nullptr, residual ? residual + begin * I : nullptr, out_ptr + begin * I, I);
  });
}

// The GEMM paths' output plus the residual (their BLAS / oneDNN calls run unfused).
at::Tensor plus(at::Tensor y, const std::optional<at::Tensor>& residual) {
  return residual ? y.add_(*residual) : y;
}

// Whether x's T rows take the token-lanes kernel: kSkinnyMaxT < T <= kLanesMaxT, in float32 and
// in bfloat16 where the AVX512-BF16 pair kernel applies (K even), the range where it is faster
// than torch's BLAS (MKL) and oneDNN at orca-tiny's shapes, or even with them at its top end.
// float16 stays on BLAS.
bool takes_lanes(const at::Tensor& x) {
  const int64_t T = x.size(0);
  return T > kSkinnyMaxT && T <= kLanesMaxT &&
         (x.scalar_type() == at::kFloat ||
          (kBf16Dot<at::BFloat16> && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0));
}

at::Tensor packed_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const std::optional<at::Tensor>& bias_in,
                             c10::string_view activation,
                             const std::optional<at::Tensor>& residual_in, c10::string_view norm,
                             const std::optional<at::Tensor>& norm_weight,
                             const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const auto [act, input_norm] = check_linear_inputs(
      x_in, weight_in, bias_in, activation, residual_in, norm, norm_weight, norm_bias, norm_eps);
  const at::Tensor x = input_norm.kind == NormKind::kNone
                           ? x_in.contiguous()
                           : normalized_input(x_in.contiguous(), input_norm);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t T = x.size(0);
  const int64_t n_out = is_gated(act) ? weight.size(0) / 2 : weight.size(0);
  const bool lanes = takes_lanes(x);
  const bool gemm = T > kSkinnyMaxT && !lanes;
  if (gemm && x.scalar_type() == at::kFloat && !is_gated(act)) {
    const char* attr = act == Activation::kGeluTanh ? "gelu"
                       : act == Activation::kRelu   ? "relu"
                                                    : "none";
    if (auto y = onednn_linear(x, weight, bias_in, attr,
                               act == Activation::kGeluTanh ? "tanh" : "")) {
      return plus(*y, residual_in);
    }
  }
  if (gemm && act == Activation::kNone) {
    return plus(bias_in ? at::addmm(*bias_in, x, weight.t()) : at::mm(x, weight.t()),
                residual_in);
  }
  at::Tensor out = at::empty({T, n_out}, x.options());
  if (T == 0 || n_out == 0) return out;
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  const at::Tensor residual = residual_in ? residual_in->contiguous() : at::Tensor();
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "packed_linear", [&] {
    const scalar_t* bias_ptr = bias_in ? bias.data_ptr<scalar_t>() : nullptr;
    const scalar_t* res_ptr = residual_in ? residual.data_ptr<scalar_t>() : nullptr;
    if (T <= kSkinnyMaxT) {
      return dispatch_skinny(T, act, [&]<int kT, Activation a>() {
        skinny_linear<kT, scalar_t, a>(x, weight, bias_ptr, res_ptr, out);
      });
    }
    if constexpr (std::is_same_v<scalar_t, float> || kBf16Dot<scalar_t>) {
      if (lanes) {
        const auto run = [&]<Activation a>() {
          return T <= 16 ? lanes_linear<1, scalar_t, a>(x, weight, bias_ptr, res_ptr, out)
                         : lanes_linear<2, scalar_t, a>(x, weight, bias_ptr, res_ptr, out);
        };
        switch (act) {
          case Activation::kNone: return run.template operator()<Activation::kNone>();
          case Activation::kGeluTanh: return run.template operator()<Activation::kGeluTanh>();
          case Activation::kRelu: return run.template operator()<Activation::kRelu>();
          case Activation::kSiluAndMul: return run.template operator()<Activation::kSiluAndMul>();
          case Activation::kGeluTanhAndMul:
            return run.template operator()<Activation::kGeluTanhAndMul>();
        }
      }
    }
    const at::Tensor* bias_t = bias_in ? &bias : nullptr;
    switch (act) {
      case Activation::kGeluTanh:
        return tiled_linear<scalar_t, Activation::kGeluTanh>(x, weight, bias_t, res_ptr, out);
      case Activation::kRelu:
        return tiled_linear<scalar_t, Activation::kRelu>(x, weight, bias_t, res_ptr, out);
      case Activation::kGeluTanhAndMul:
        return gemm_and_mul<scalar_t, Activation::kGeluTanhAndMul>(x, weight, bias_t, res_ptr,
                                                                   out);
      default:
        return gemm_and_mul<scalar_t, Activation::kSiluAndMul>(x, weight, bias_t, res_ptr, out);
    }
  });
  return out;
}

// logits_linear beyond the skinny and lanes kernels (torch's CPU GEMMs have no float32 output
// for bfloat16 / float16 inputs): per tile of weight rows, the rows widened to float32 in a
// cache-sized thread-local buffer, then one float32 GEMM of all tokens into the tile's columns.
template <typename scalar_t>
void widened_linear(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const int64_t K = x.size(1), N = out.size(1);
  const at::Tensor x_float = x.to(at::kFloat);
  // Each tile is a single-threaded GEMM: at least two per thread, a multiple of the threads.
  const int64_t threads = at::get_num_threads();
  int64_t tiles = std::max(ceil_div(N * K, kTileBufferElems), 2 * threads);
  while (tiles % threads != 0) ++tiles;
  const int64_t tile_rows = ceil_div(ceil_div(N, tiles), 16) * 16;
  tiles = ceil_div(N, tile_rows);
  // The workers take the caller's thread-local state: under inference mode out is an inference
  // tensor, which only inference mode may write.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor buf = at::empty({tile_rows, K}, x_float.options());
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * tile_rows, rows = std::min(tile_rows, N - n0);
      at::Tensor w = buf.narrow(0, 0, rows);
      w.copy_(weight.narrow(0, n0, rows));
      // The [T, rows] column slice of out, written in place (BLAS takes its row stride as ldc).
      at::Tensor cols = out.narrow(1, n0, rows);
      at::mm_out(cols, x_float, w.t());
    }
  });
}

at::Tensor logits_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             c10::string_view norm, const std::optional<at::Tensor>& norm_weight,
                             const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  if (x_in.scalar_type() == at::kFloat) {  // packed_linear's float32 paths, which check x
    return packed_linear_cpu(x_in, weight_in, std::nullopt, "none", std::nullopt, norm,
                             norm_weight, norm_bias, norm_eps);
  }
  const InputNorm input_norm = check_linear_inputs(x_in, weight_in, std::nullopt, "none",
                                                   std::nullopt, norm, norm_weight, norm_bias,
                                                   norm_eps).norm;
  const at::Tensor x = input_norm.kind == NormKind::kNone
                           ? x_in.contiguous()
                           : normalized_input(x_in.contiguous(), input_norm);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kFloat));
  if (T == 0 || N == 0 || K == 0) return out.zero_();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "logits_linear", [&] {
    if (T <= kSkinnyMaxT) {
      return cpu::dispatch_tokens(T, [&]<int kT>() {
        skinny_linear<kT, scalar_t, Activation::kNone, float>(x, weight, nullptr, nullptr, out);
      });
    }
    if constexpr (kBf16Dot<scalar_t>) {
      if (takes_lanes(x)) {
        return T <= 16
                   ? lanes_linear<1, scalar_t, Activation::kNone, float>(x, weight, nullptr,
                                                                          nullptr, out)
                   : lanes_linear<2, scalar_t, Activation::kNone, float>(x, weight, nullptr,
                                                                          nullptr, out);
      }
    }
    widened_linear<scalar_t>(x, weight, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("logits_linear", &logits_linear_cpu);
}

}  // namespace orca
