// quantized_linear on CPU: y = act(norm(x) @ W^T + b) + residual, W held as GGUF blocks (q8_0,
// q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K: orca/cpu/quant_formats.h), with packed_linear's
// epilogue.
// Up to 24 tokens (16 for bfloat16 x) each weight row's blocks are read from memory once and
// dequantized in registers for up to 8 tokens at a time (orca/cpu/quant_kernel.h), in blocks of
// kSkinnyBlock output columns (a further 8 tokens re-read the block from cache).
// Beyond, each task dequantizes a cache-sized panel of weight rows (float32, or bfloat16 for
// bfloat16 x) and runs one GEMM of all tokens against it (at::mm: MKL / oneDNN), then the
// epilogue on the panel's output columns while they are in cache.
// avx512_vnni's float32 x beyond kDotMaxTInt16 tokens takes the int16 GEMM instead of the panels
// (orca/cpu/quant_int16.h: x rounded to int16 per block, each panel's quants unpacked to int16),
// and so does amx_int8's where a call refuses int8 activations. On the x16 layout, such a call
// of up to 12 tokens (4 on amx_int8) runs the int8 kernels on each token's two int8 parts and
// those of their remainder (as fine as float32); more take the int16 GEMM or amx_int8's tiles.
// The kernels' ISA (portable, avx2, avx512, avx512_vnni: avx512 with int8 activations for up to
// kInt8MaxT tokens, every format; amx_int8: avx512_vnni with AMX-INT8 tile products on
// activations split into two int8 parts for more: any number of float32 tokens, up to
// kAmxMaxTBf16 bfloat16 ones, every format) is the best this CPU runs, or
// orca_ext._C.set_isa("quant", ...)'s (seeded by ORCA_QUANT_ISA).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "isa_choice.h"
#include "normalized_input.h"
#include "quant_blocks.h"

namespace orca {

using cpu::quant::Format;
using cpu::quant::Isa;

// The most tokens the dot kernels take, per dtype of x: where they stopped beating the panels'
// GEMM at SmolLM2-135M's shapes (bfloat16's GEMM, on AMX where the CPU has it, wins sooner).
constexpr int64_t kDotMaxTFloat = 24, kDotMaxTBf16 = 16;
// avx512_vnni's float32 tokens: one pass of the dot kernels, then the int16 GEMM, which gains on
// a second pass from 9 to 12 tokens at those shapes, every format.
constexpr int64_t kDotMaxTInt16 = cpu::quant::kMaxDotTokens;
// The most tokens kAmxInt8's tile kernels take for bfloat16 x, where the panels' bfloat16 GEMM
// (AMX in oneDNN) overtakes them; float32 x's GEMM never does.
constexpr int64_t kAmxMaxTBf16 = 64;
// The tokens of one pass of kAmxInt8's tile kernels over all weight rows: their activations
// (2 bytes a value) stay in L2 while each group of weight rows reads them.
constexpr int64_t kAmxChunkT = 256;
constexpr int64_t kPanelBytes = 1024 * 1024;  // per thread: a dequantized panel, half an L2

// The formats by name: ggml's type names, and orca's q8_m.
constexpr std::pair<const char*, Format> kFormatNames[] = {
    {"q8_0", Format::kQ8_0}, {"q4_0", Format::kQ4_0}, {"q4_1", Format::kQ4_1},
    {"q5_0", Format::kQ5_0}, {"q5_1", Format::kQ5_1}, {"q8_m", Format::kQ8_M},
    {"q4_K", Format::kQ4_K}, {"q5_K", Format::kQ5_K}, {"q6_K", Format::kQ6_K}};

namespace {

// 'q8_0', 'q4_0', ...: the names for an error message.
std::string format_names() {
  std::string names;
  for (const auto& [known, format] : kFormatNames) {
    names += (names.empty() ? "'" : ", '") + std::string(known) + "'";
  }
  return names;
}

// The format named `name`, if any.
std::optional<Format> known_format(c10::string_view name) {
  for (const auto& [known, format] : kFormatNames) {
    if (name == known) return format;
  }
  return std::nullopt;
}

}  // namespace

Format parse_quant_format(c10::string_view name, const char* what) {
  const std::optional<Format> format = known_format(name);
  TORCH_CHECK(format, what, " must be one of ", format_names(), ", got '", std::string(name),
              "'");
  return *format;
}

QuantLayout parse_quant_layout(c10::string_view name, const char* what) {
  const c10::string_view suffix = kRows16Suffix;
  const bool rows16 = name.size() > suffix.size() && name.ends_with(suffix);
  const std::optional<Format> format =
      known_format(rows16 ? name.substr(0, name.size() - suffix.size()) : name);
  if (format) return {*format, rows16};
  TORCH_CHECK(false, what, " must be one of ", format_names(), ", or one of them with '",
              kRows16Suffix, "' (the x16 layout), got '", std::string(name), "'");
}

void check_block_rows(const at::Tensor& qweight, Format fmt, c10::string_view format, int64_t K,
                      const char* k_name) {
  const int64_t block = cpu::quant::weights_per_block(fmt);
  TORCH_CHECK(K >= 0 && K % block == 0, k_name, " must be a non-negative multiple of ", block,
              " (the block size of ", std::string(format), "), got ", K);
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, K);
  TORCH_CHECK(qweight.size(1) == row_bytes, "qweight has ", qweight.size(1),
              " bytes per row but ", k_name, " = ", K, " in ", std::string(format),
              " blocks takes ", row_bytes, " (", cpu::quant::block_bytes(fmt), " bytes per ",
              block, " weights)");
}

void check_rows16_rows(const at::Tensor& qweight, c10::string_view format, bool gated) {
  const int64_t part_rows = gated ? qweight.size(0) / 2 : qweight.size(0);
  TORCH_CHECK(part_rows % cpu::quant::kRowGroup == 0, "qweight in the x16 layout ('",
              std::string(format), "') must have a multiple of ", cpu::quant::kRowGroup,
              " rows", gated ? " in each of its gate and up halves" : "", ", got ",
              qweight.size(0));
}

QuantArgs check_quantized_linear_inputs(const at::Tensor& x, const at::Tensor& qweight,
                                        c10::string_view format, int64_t in_features,
                                        const std::optional<at::Tensor>& bias,
                                        c10::string_view activation,
                                        const std::optional<at::Tensor>& residual,
                                        c10::string_view norm,
                                        const std::optional<at::Tensor>& norm_weight,
                                        const std::optional<at::Tensor>& norm_bias,
                                        double norm_eps) {
  const QuantLayout layout = parse_quant_layout(format);
  const Format fmt = layout.format;
  const Activation act = parse_activation(activation);
  check_dim(x, "x", 2, "[T, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU, got ", x.device());
  check_dim(qweight, "qweight", 2, "[N, K / block_weights * block_bytes] (uint8 GGUF blocks)");
  check_dtype(qweight, "qweight", at::kByte);
  check_same_device(qweight, "qweight", x, "x");
  check_block_rows(qweight, fmt, format, in_features, "in_features");
  TORCH_CHECK(x.size(1) == in_features, "x is ", shape_str(x), " but in_features = ",
              in_features, ": x.size(1) must equal in_features (K)");
  if (layout.rows16) check_rows16_rows(qweight, format, is_gated(act));
  return {layout, act, check_epilogue_inputs(x, qweight.size(0), "qweight", act, bias, residual,
                                             norm, norm_weight, norm_bias, norm_eps)};
}

namespace {

// The dot kernels' tokens: the groups of kRowGroup output columns split across the threads.
template <typename scalar_t, Activation act>
void dot_linear(Isa isa, QuantLayout layout, const float* x, Int8Path path,
                const uint8_t* x_int8, int64_t T, int64_t K, const uint8_t* w,
                const scalar_t* bias, const scalar_t* residual, scalar_t* out, int64_t N) {
  at::parallel_for(0, ceil_div(N, cpu::quant::kRowGroup), quant_group_grain(K, act),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> y(2 * T * kSkinnyBlock);
    quant_dot_groups<scalar_t, act>(isa, layout, x, path, x_int8, T, K, w, bias, residual, out,
                                    N, begin, end, y.data(), y.data() + T * kSkinnyBlock);
  });
}

struct PanelPlan {
  int64_t rows;   // weight rows per panel (of each part for gated acts), a multiple of 16
  int64_t count;  // panels
};

// Panels of up to kPanelBytes of `element_bytes` per weight (rows a multiple of 16), one GEMM
// call each (fewer, larger calls ran faster, oneDNN's bfloat16 ones most), at least one per
// thread and a multiple of the threads, so that no core idles on the last one.
PanelPlan panel_plan(int64_t N, int64_t K, int64_t parts, int64_t element_bytes) {
  const int64_t threads = at::get_num_threads();
  const int64_t panel_rows =
      std::max<int64_t>(16, kPanelBytes / (parts * std::max<int64_t>(K, 1) * element_bytes));
  int64_t panels = std::max(ceil_div(N, panel_rows), std::min(threads, ceil_div(N, 16)));
  if (panels > threads) panels = ceil_div(panels, threads) * threads;
  const int64_t rows_per_panel = ceil_div(ceil_div(N, panels), 16) * 16;
  return {rows_per_panel, ceil_div(N, rows_per_panel)};
}

// More tokens: per task, panels of weight rows dequantized to x's dtype (gate and up rows side
// by side for gated acts), one single-threaded GEMM of all tokens per panel into a
// thread-local buffer, and the epilogue from there into out.
template <typename scalar_t, Activation act>
void panel_linear(Isa isa, QuantLayout layout, const at::Tensor& x, const uint8_t* w,
                  const scalar_t* bias, const scalar_t* residual, at::Tensor& out) {
  const Format fmt = layout.format;
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, K);
  const int64_t parts = is_gated(act) ? 2 : 1;
  const int64_t half = parts == 2 ? N : 0;  // offset of the up rows
  const auto [rows_per_panel, panels] = panel_plan(N, K, parts, x.element_size());
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  // The workers take the caller's thread-local state: under inference mode their tensors are
  // inference tensors, which only inference mode may write.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor panel = at::empty({parts * rows_per_panel, K}, x.options());
    at::Tensor buffer = at::empty({T * parts * rows_per_panel}, x.options());
    std::vector<uint8_t> file_layout;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * rows_per_panel, rows = std::min(rows_per_panel, N - n0);
      for (int64_t part = 0; part < parts; ++part) {
        const uint8_t* src = file_rows(layout, w + (part * half + n0) * row_bytes, K, rows,
                                       file_layout);
        scalar_t* dst = panel.data_ptr<scalar_t>() + part * rows * K;
        if constexpr (std::is_same_v<scalar_t, float>) {
          cpu::quant::dequantize_rows(isa, fmt, src, K, rows, dst);
        } else {
          cpu::quant::dequantize_rows(isa, fmt, src, K, rows, reinterpret_cast<uint16_t*>(dst));
        }
      }
      at::Tensor y = buffer.narrow(0, 0, T * parts * rows).view({T, parts * rows});
      at::mm_out(y, x, panel.narrow(0, 0, parts * rows).t());
      const scalar_t* y_ptr = y.data_ptr<scalar_t>();
      epilogue<act, scalar_t, scalar_t>(y_ptr, parts == 2 ? y_ptr + rows : nullptr, parts * rows,
                                        T, rows, bias ? bias + n0 : nullptr,
                                        bias && half ? bias + half + n0 : nullptr,
                                        residual ? residual + n0 : nullptr, out_ptr + n0, N);
    }
  });
}

// More float32 tokens on avx512_vnni: x rounded to int16 tiles once, then per task panels of
// weight rows unpacked to int16 quants (gate and up rows side by side for gated acts), the
// int16 GEMM of all tokens against each into a thread-local buffer, and the epilogue from there
// into out.
template <Activation act>
void int16_linear(QuantLayout layout, const at::Tensor& x, const uint8_t* w, const float* bias,
                  const float* residual, at::Tensor& out) {
  const Format fmt = layout.format;
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, K);
  const int64_t parts = is_gated(act) ? 2 : 1;
  const int64_t half = parts == 2 ? N : 0;  // offset of the up rows
  // Scratch left uninitialized (every byte read is written first).
  const auto x_int16 =
      std::make_unique_for_overwrite<uint8_t[]>(cpu::quant::int16_activation_bytes(T, K));
  const float* x_ptr = x.data_ptr<float>();
  at::parallel_for(0, cpu::quant::int16_tiles(T), 1, [&](int64_t begin, int64_t end) {
    cpu::quant::quantize_activations_int16(x_ptr, T, K, begin, end, x_int16.get());
  });
  const auto [rows_per_panel, panels] = panel_plan(N, K, parts, sizeof(int16_t));
  const int64_t padded = cpu::quant::int16_padded_rows(rows_per_panel);
  const int64_t groups = K / cpu::quant::int16_group_weights(fmt);
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const auto quants = std::make_unique_for_overwrite<int16_t[]>(padded * K);
    const auto scales = std::make_unique_for_overwrite<float[]>(padded * groups);
    const auto offsets = std::make_unique_for_overwrite<float[]>(padded * (K / 32));
    const auto y = std::make_unique_for_overwrite<float[]>(T * parts * rows_per_panel);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * rows_per_panel, rows = std::min(rows_per_panel, N - n0);
      for (int64_t part = 0; part < parts; ++part) {
        cpu::quant::unpack_rows_int16(fmt, w + (part * half + n0) * row_bytes, layout.rows16, K,
                                      rows, quants.get(), scales.get(), offsets.get());
        cpu::quant::gemm_rows_int16(fmt, x_int16.get(), T, K, quants.get(), scales.get(),
                                    offsets.get(), rows, y.get() + part * rows, parts * rows);
      }
      epilogue<act, float, float>(y.get(), parts == 2 ? y.get() + rows : nullptr, parts * rows,
                                  T, rows, bias ? bias + n0 : nullptr,
                                  bias && half ? bias + half + n0 : nullptr,
                                  residual ? residual + n0 : nullptr, out_ptr + n0, N);
    }
  });
}

at::Tensor quantized_linear_cpu(const at::Tensor& x_in, const at::Tensor& qweight_in,
                                c10::string_view format, int64_t in_features,
                                const std::optional<at::Tensor>& bias_in,
                                c10::string_view activation,
                                const std::optional<at::Tensor>& residual_in,
                                c10::string_view norm,
                                const std::optional<at::Tensor>& norm_weight,
                                const std::optional<at::Tensor>& norm_bias, double norm_eps,
                                bool int8_activations) {
  const auto [layout, act, input_norm] =
      check_quantized_linear_inputs(x_in, qweight_in, format, in_features, bias_in, activation,
                                    residual_in, norm, norm_weight, norm_bias, norm_eps);
  const Isa isa = quant_isa_choice().get();
  const at::Tensor x = input_norm.kind == NormKind::kNone
                           ? x_in.contiguous()
                           : normalized_input(x_in.contiguous(), input_norm);
  const at::Tensor qweight = qweight_in.contiguous();
  const int64_t T = x.size(0), K = in_features;
  const int64_t n_out = is_gated(act) ? qweight.size(0) / 2 : qweight.size(0);
  at::Tensor out = at::empty({T, n_out}, x.options());
  if (T == 0 || n_out == 0) return out;
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  const at::Tensor residual = residual_in ? residual_in->contiguous() : at::Tensor();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const auto run = [&]<typename scalar_t, Activation a>() {
    const scalar_t* bias_ptr = bias_in ? bias.data_ptr<scalar_t>() : nullptr;
    const scalar_t* res_ptr = residual_in ? residual.data_ptr<scalar_t>() : nullptr;
    const Format fmt = layout.format;
    const Int8Path path = int8_path(isa, layout, T, int8_activations);
    constexpr bool kFloat = std::is_same_v<scalar_t, float>;
    const bool int16_gemm = kFloat && path == Int8Path::kNone &&
                            (isa == Isa::kAvx512Vnni || isa == Isa::kAmxInt8);
    const bool int8_dot = path == Int8Path::kVnni || path == Int8Path::kVnniFine;
    const int64_t dot_max_t = path == Int8Path::kAmx    ? (kFloat ? T : kAmxMaxTBf16)
                              : int8_dot                ? T
                              : int16_gemm              ? kDotMaxTInt16
                              : kFloat                  ? kDotMaxTFloat
                                                        : kDotMaxTBf16;
    if (T <= dot_max_t) {
      const at::Tensor x_float = x.to(at::kFloat).contiguous();
      const float* xf = x_float.data_ptr<float>();
      const int64_t chunk = path == Int8Path::kAmx ? kAmxChunkT : T;
      const at::Tensor x_int8 =
          at::empty({int8_bytes(path, std::min(T, chunk), K)}, x.options().dtype(at::kByte));
      uint8_t* x_int8_ptr = x_int8.data_ptr<uint8_t>();
      scalar_t* out_ptr = out.data_ptr<scalar_t>();
      for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t tokens = std::min(chunk, T - t0);
        const float* x_chunk = xf + t0 * K;
        if (path == Int8Path::kAmx) {
          // Each group of G tokens is its own slice of the tiles' layout: rounded in parallel.
          const int64_t G = cpu::quant::amx_group_tokens(tokens);
          const int64_t group_bytes = cpu::quant::amx_activation_bytes(G, K);
          at::parallel_for(0, ceil_div(tokens, G), 1, [&](int64_t begin, int64_t end) {
            for (int64_t g = begin; g < end; ++g) {
              cpu::quant::quantize_activations_amx(x_chunk + g * G * K,
                                                   std::min(G, tokens - g * G), K, G,
                                                   x_int8_ptr + g * group_bytes);
            }
          });
        } else {
          quantize_for(path, fmt, x_chunk, tokens, K, x_int8_ptr);
        }
        dot_linear<scalar_t, a>(isa, layout, x_chunk, path, x_int8_ptr, tokens, K, w, bias_ptr,
                                res_ptr ? res_ptr + t0 * n_out : nullptr, out_ptr + t0 * n_out,
                                n_out);
      }
      return;
    }
    if constexpr (kFloat) {
      if (int16_gemm) return int16_linear<a>(layout, x, w, bias_ptr, res_ptr, out);
    }
    panel_linear<scalar_t, a>(isa, layout, x, w, bias_ptr, res_ptr, out);
  };
  const auto run_dtype = [&]<typename scalar_t>() {
    switch (act) {
      case Activation::kNone: return run.template operator()<scalar_t, Activation::kNone>();
      case Activation::kGeluTanh:
        return run.template operator()<scalar_t, Activation::kGeluTanh>();
      case Activation::kRelu: return run.template operator()<scalar_t, Activation::kRelu>();
      case Activation::kSiluAndMul:
        return run.template operator()<scalar_t, Activation::kSiluAndMul>();
      case Activation::kGeluTanhAndMul:
        return run.template operator()<scalar_t, Activation::kGeluTanhAndMul>();
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run_dtype.template operator()<float>();
  } else {
    run_dtype.template operator()<c10::BFloat16>();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("quantized_linear", &quantized_linear_cpu); }

}  // namespace orca
