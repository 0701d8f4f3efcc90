// DecoderStack on CPU: a stack of pre-norm transformer blocks (GPT-2 and Llama shaped) in
// one call. Each block: qkv = linear(norm(x)); rotary on q and k; store_kv; attention;
// x += linear(attention); x += linear(act(linear(norm(x)))).
//
// Up to kSkinnyMaxT tokens (decode at small batch; kQuantStackMaxT for GGUF blocks, whose dot
// kernels take any number of tokens, on amx_int8) the whole stack runs in ONE parallel region:
// each linear's blocks split across the threads as packed_linear's skinny path splits them,
// the attention's work items (the same plan for every layer) handed out dynamically, and a
// barrier wherever a step needs the previous one's whole output, so a step pays one dispatch
// and one fork-join instead of one per op. The kernels, their work split and their rounding are
// packed_linear's and ragged_attention's, so the results are the per-op blocks' bit for bit.
#include "decoder_stack.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <memory>

#include "attention_plan.h"
#include "orca/cpu/norm.h"
#include "normalized_input.h"
#include "quant_blocks.h"
#include "skinny_blocks.h"

namespace orca {
namespace {

// The most tokens a stack of quantized layers takes a call (its linears' y scratch).
constexpr int64_t kQuantStackMaxT = 64;
static_assert(kQuantStackMaxT <= kRowNormMaxT, "the per-op linears' norms must be the stack's");

struct StackShape {
  int64_t T, hidden, num_heads, num_kv_heads, head_dim, qkv_width, inter;
  NormKind norm;
  Activation act;
  cpu::quant::Isa isa;  // the quantized linears' kernels (chosen_quant_isa, once per call)
  cpu::AttentionIsa attention_isa;  // the attention's (chosen_attention_isa, once per call)
};

// q and k heads of qkv rows [T, stride] rotated in place (neox rotate-half), by cos / sin
// [T, D / 2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over each head's halves. Each
// product and sum is rounded to scalar_t as the models' apply_rotary (torch ops) rounds it, so
// the results are the same bits; `volatile` keeps the compiler from fusing them into FMAs.
template <typename scalar_t>
void rotate_rows(scalar_t* qkv, int64_t begin, int64_t end, int64_t stride, int64_t heads,
                 int64_t D, const scalar_t* cos, const scalar_t* sin) {
  const int64_t half = D / 2;
  const auto rounded = [](float v) -> float {
    volatile float r = static_cast<float>(static_cast<scalar_t>(v));
    return r;
  };
  for (int64_t t = begin; t < end; ++t) {
    const scalar_t* c = cos + t * half;
    const scalar_t* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* x1 = qkv + t * stride + h * D;
      scalar_t* x2 = x1 + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i], ci = c[i], si = s[i];
        x1[i] = static_cast<scalar_t>(rounded(a * ci) - rounded(b * si));
        x2[i] = static_cast<scalar_t>(rounded(b * ci) + rounded(a * si));
      }
    }
  }
}

// Rows [begin, end) of the k / v heads in qkv copied into their cache slots (negative: none).
template <typename scalar_t>
void store_rows(const scalar_t* qkv, int64_t begin, int64_t end, const StackShape& s,
                const int64_t* slots, scalar_t* k_cache, scalar_t* v_cache) {
  const int64_t width = s.num_kv_heads * s.head_dim;
  const int64_t k_off = s.num_heads * s.head_dim, v_off = k_off + width;
  for (int64_t t = begin; t < end; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_cache + slots[t] * width, qkv + t * s.qkv_width + k_off,
                width * sizeof(scalar_t));
    std::memcpy(v_cache + slots[t] * width, qkv + t * s.qkv_width + v_off,
                width * sizeof(scalar_t));
  }
}

// ---- Few tokens: the whole stack in one parallel region.

// The skinny kernel's input: rows [T, K] as float32 in buf, or the rows themselves for the
// bfloat16 pair kernel (as packed_linear's skinny path takes them).
template <typename scalar_t>
const void* kernel_input(const scalar_t* rows, int64_t n, float* buf) {
  if constexpr (kBf16Dot<scalar_t>) {
    return rows;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(rows[i]);
    return buf;
  }
}

// f.template operator()<a>() for the activation act.
template <typename Fn>
void dispatch_activation(Activation act, const Fn& f) {
  switch (act) {
    case Activation::kNone: return f.template operator()<Activation::kNone>();
    case Activation::kGeluTanh: return f.template operator()<Activation::kGeluTanh>();
    case Activation::kRelu: return f.template operator()<Activation::kRelu>();
    case Activation::kSiluAndMul: return f.template operator()<Activation::kSiluAndMul>();
    case Activation::kGeluTanhAndMul: return f.template operator()<Activation::kGeluTanhAndMul>();
  }
}

// One linear of the stack: its input rows [T, K], its weight (GGUF blocks where format is set),
// its epilogue's bias and residual, and its output [T, N].
template <typename scalar_t>
struct LinearStep {
  const scalar_t* rows;
  int64_t K;
  const at::Tensor& weight;
  std::optional<cpu::quant::Format> format;
  const std::optional<at::Tensor>& bias;
  const scalar_t* residual;
  scalar_t* out;
  int64_t N;
};

// This thread's blocks of a skinny linear, split as at::parallel_for splits packed_linear's (or
// quantized_linear's, whose dot path takes the same blocks and grain).
// floats (T * K) and int8 (the int8 activations' bytes) are this thread's scratch.
template <typename scalar_t>
void linear_share(const StackShape& s, Activation act, const LinearStep<scalar_t>& step,
                  float* floats, uint8_t* int8, int tid, int nth) {
  const int64_t T = s.T, K = step.K, N = step.N;
  const int64_t blocks = ceil_div(N, kSkinnyBlock);
  const int64_t workers = std::min<int64_t>(nth, ceil_div(blocks, skinny_grain(K, act)));
  if (tid >= workers) return;
  const int64_t chunk = ceil_div(blocks, workers);
  const int64_t begin = tid * chunk, end = std::min(blocks, begin + chunk);
  if (begin >= end) return;
  const scalar_t* b = step.bias ? step.bias->template data_ptr<scalar_t>() : nullptr;
  if (step.format) {
    // As quantized_linear: the rows as float32, rounded to int8 blocks for the int8 kernels.
    for (int64_t i = 0; i < T * K; ++i) floats[i] = static_cast<float>(step.rows[i]);
    const Int8Path path = int8_path(s.isa, T, true);
    quantize_for(path, *step.format, floats, T, K, int8);
    float y[2][kQuantStackMaxT * kSkinnyBlock];
    dispatch_activation(act, [&]<Activation a>() {
      quant_dot_blocks<scalar_t, a>(s.isa, *step.format, floats, path, int8, T, K,
                                    step.weight.template data_ptr<uint8_t>(), b, step.residual,
                                    step.out, N, begin, end, y[0], y[1]);
    });
    return;
  }
  const void* x = kernel_input(step.rows, T * K, floats);
  const scalar_t* w = step.weight.template data_ptr<scalar_t>();
  dispatch_skinny(T, act, [&]<int kT, Activation a>() {
    skinny_blocks<kT, scalar_t, a>(x, w, K, N, b, step.residual, step.out, begin, end);
  });
}

template <typename scalar_t>
void normalize(const scalar_t* x, const StackShape& s, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias, double eps, scalar_t* y) {
  const auto e = static_cast<float>(eps);
  if (s.norm == NormKind::kLayerNorm) {
    cpu::layer_norm_rows(x, s.T, s.hidden, weight.data_ptr<scalar_t>(),
                         bias ? bias->data_ptr<scalar_t>() : nullptr, e, y);
  } else {
    cpu::rms_norm_rows(x, s.T, s.hidden, weight.data_ptr<scalar_t>(), e, y);
  }
}

template <typename scalar_t>
void fused_stack(at::Tensor& x, const StackShape& s, const std::vector<DecoderStack::Layer>& layers,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                 const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                 const at::Tensor& block_table, const at::Tensor& slot_mapping,
                 const std::optional<at::Tensor>& rotary_cos,
                 const std::optional<at::Tensor>& rotary_sin, double eps, int64_t step_begin,
                 int64_t step_end, bool add_residual) {
  const int64_t T = s.T, H = s.hidden, D = s.head_dim;
  const int64_t L = static_cast<int64_t>(layers.size());
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const AttentionShape as{T, s.num_heads, s.num_kv_heads, D, k_caches[0].size(0),
                          k_caches[0].size(1), context_lens.size(0), block_table.size(1)};
  const Plan plan = make_plan(as, cu, ctx, std::is_same_v<scalar_t, c10::BFloat16> &&
                                                cpu::amx_head_dim(s.attention_isa, D));
  const auto items = static_cast<int64_t>(plan.items.size());
  const auto merges = static_cast<int64_t>(plan.merges.size());
  const auto opts = x.options();
  const int64_t widest = std::max({H, s.num_heads * D, s.inter});
  const int nth = at::in_parallel_region() ? 1 : at::get_num_threads();
  // Shared between the threads: the projections, the attention output and the MLP's middle;
  // each thread's own: a normalized input and its float32 copy for the kernel.
  at::Tensor qkv = at::empty({T, s.qkv_width}, opts), attn = at::empty({T, s.num_heads * D}, opts),
             mid = at::empty({T, s.inter}, opts);
  at::Tensor normed = at::empty({nth, T * H}, opts);
  at::Tensor floats = at::empty({nth, T * widest}, opts.dtype(at::kFloat));
  const int64_t int8_bytes = std::max(cpu::quant::int8_activation_bytes(T, widest),
                                      cpu::quant::amx_activation_bytes(T, widest));
  at::Tensor int8 = at::empty({nth, int8_bytes}, opts.dtype(at::kByte));
  at::Tensor part_o = at::empty({plan.partial_rows, D}, opts.dtype(at::kFloat));
  at::Tensor part_ml = at::empty({2, plan.partial_rows}, opts.dtype(at::kFloat));
  const cpu::Partials part{part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                           part_ml.data_ptr<float>() + plan.partial_rows};
  // Per layer: the next attention item and merge to hand out.
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[2 * L]);
  for (int64_t i = 0; i < 2 * L; ++i) next[i] = 0;
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* qkv_p = qkv.data_ptr<scalar_t>();
  scalar_t* attn_p = attn.data_ptr<scalar_t>();
  scalar_t* mid_p = mid.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* rot_cos = rotary_cos ? rotary_cos->data_ptr<scalar_t>() : nullptr;
  const scalar_t* rot_sin = rotary_sin ? rotary_sin->data_ptr<scalar_t>() : nullptr;

  at::internal::lazy_init_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    const c10::ParallelGuard guard(true);
    thread_local cpu::AttentionScratch scratch;
    scalar_t* my_normed = normed.data_ptr<scalar_t>() + tid * T * H;
    float* my_floats = floats.data_ptr<float>() + tid * T * widest;
    uint8_t* my_int8 = int8.data_ptr<uint8_t>() + tid * int8_bytes;
    // Step 2l is layer l's attention half, 2l + 1 its MLP half; each ends in a linear whose
    // epilogue adds the residual, or not (a tensor-parallel rank's partial sum).
    scalar_t* residual = add_residual ? xp : nullptr;
    for (int64_t step = step_begin; step < step_end; ++step) {
      const int64_t l = step / 2;
      const DecoderStack::Layer& w = layers[l];
      if (step % 2 == 1) {
        normalize(xp, s, w.mlp_norm, w.mlp_norm_bias, eps, my_normed);
        linear_share<scalar_t>(s, s.act, {my_normed, H, w.up, w.up_format, w.up_bias, nullptr,
                                          mid_p, s.inter}, my_floats, my_int8, tid, team);
#pragma omp barrier
        linear_share<scalar_t>(s, Activation::kNone, {mid_p, s.inter, w.down, w.down_format,
                                                      w.down_bias, residual, xp, H},
                               my_floats, my_int8, tid, team);
#pragma omp barrier
        continue;
      }
      normalize(xp, s, w.attn_norm, w.attn_norm_bias, eps, my_normed);
      linear_share<scalar_t>(s, Activation::kNone, {my_normed, H, w.qkv, w.qkv_format,
                                                    w.qkv_bias, nullptr, qkv_p, s.qkv_width},
                             my_floats, my_int8, tid, team);
#pragma omp barrier
      if (tid == 0) {
        if (rot_cos) {
          rotate_rows(qkv_p, 0, T, s.qkv_width, s.num_heads + s.num_kv_heads, D, rot_cos,
                      rot_sin);
        }
        store_rows(qkv_p, 0, T, s, slots, k_caches[l].data_ptr<scalar_t>(),
                   v_caches[l].data_ptr<scalar_t>());
      }
#pragma omp barrier
      const cpu::AttentionArgs<scalar_t> args{
          qkv_p, s.qkv_width, D, k_caches[l].data_ptr<scalar_t>(),
          v_caches[l].data_ptr<scalar_t>(),
          attn_p, cu, ctx, block_table.data_ptr<int32_t>(), as.max_blocks, as.block_size,
          s.num_heads, s.num_kv_heads, D, static_cast<float>(w.scale)};
      dispatch_attention_isa<scalar_t>(s.attention_isa, [&]<cpu::AttentionIsa kIsa>() {
        dispatch_head_dim(D, [&]<int kD>() {
          for (int64_t i = next[2 * l]++; i < items; i = next[2 * l]++) {
            cpu::attend<kD, kIsa>(args, plan.items[i], scratch, part);
          }
        });
      });
      if (merges > 0) {
#pragma omp barrier
        for (int64_t i = next[2 * l + 1]++; i < merges; i = next[2 * l + 1]++) {
          cpu::merge_partials(args, plan.merges[i].first, plan.merges[i].second, part);
        }
      }
#pragma omp barrier
      linear_share<scalar_t>(s, Activation::kNone, {attn_p, s.num_heads * D, w.out,
                                                    w.out_format, w.out_bias, residual, xp, H},
                             my_floats, my_int8, tid, team);
#pragma omp barrier
    }
  }
}

}  // namespace

DecoderStack::DecoderStack(std::string norm, double norm_eps, std::string activation,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
    : norm_(parse_norm(norm)),
      norm_eps_(norm_eps),
      act_(parse_activation(activation)),
      activation_name_(std::move(activation)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim) {
  TORCH_CHECK(norm_ != NormKind::kNone, "DecoderStack needs a norm ('layer_norm' or "
              "'rms_norm'), got 'none'");
  TORCH_CHECK(std::isfinite(norm_eps) && norm_eps >= 0, "norm_eps must be finite and >= 0, got ",
              norm_eps);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads (", num_heads, ") must be a positive multiple of num_kv_heads (",
              num_kv_heads, ")");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be a positive even number, got ",
              head_dim);
}

int64_t DecoderStack::max_tokens() const {
  // amx_int8's tile kernels gain on the per-op path's panels up to kQuantStackMaxT tokens; the
  // float dot kernels, 8 tokens a pass, do not beyond kSkinnyMaxT.
  const bool quantized = !layers_.empty() && layers_[0].qkv_format.has_value();
  return quantized && chosen_quant_isa() == cpu::quant::Isa::kAmxInt8 ? kQuantStackMaxT
                                                                      : kSkinnyMaxT;
}

void DecoderStack::add_layer(
    const at::Tensor& attn_norm_weight, const std::optional<at::Tensor>& attn_norm_bias,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& out_weight, const std::optional<at::Tensor>& out_bias,
    const at::Tensor& mlp_norm_weight, const std::optional<at::Tensor>& mlp_norm_bias,
    const at::Tensor& up_weight, const std::optional<at::Tensor>& up_bias,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& down_bias, double scale) {
  const int64_t l = num_layers();
  check_dim(qkv_weight, "qkv_weight", 2, "[(num_heads + 2 * num_kv_heads) * head_dim, hidden]");
  TORCH_CHECK(qkv_weight.device().is_cpu(), "DecoderStack runs on the CPU; layer ", l,
              "'s qkv_weight is on ", qkv_weight.device());
  const int64_t hidden = qkv_weight.size(1);
  if (l > 0) {
    TORCH_CHECK(qkv_weight.scalar_type() == dtype_ && hidden == hidden_,
                "layer ", l, "'s qkv_weight is ", qkv_weight.scalar_type(), " ",
                shape_str(qkv_weight), "; the stack's layers are ", dtype_, ", ", hidden_,
                " wide");
  }
  const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
  TORCH_CHECK(qkv_weight.size(0) == qkv_width, "layer ", l, "'s qkv_weight must have "
              "(num_heads + 2 * num_kv_heads) * head_dim = ", qkv_width, " rows, got shape ",
              shape_str(qkv_weight));
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a finite positive number, got ",
              scale, " for layer ", l);
  const std::pair<const std::optional<at::Tensor>, const char*> tensors[] = {
      {attn_norm_weight, "attn_norm_weight"}, {attn_norm_bias, "attn_norm_bias"},
      {qkv_bias, "qkv_bias"}, {out_weight, "out_weight"}, {out_bias, "out_bias"},
      {mlp_norm_weight, "mlp_norm_weight"}, {mlp_norm_bias, "mlp_norm_bias"},
      {up_weight, "up_weight"}, {up_bias, "up_bias"}, {down_weight, "down_weight"},
      {down_bias, "down_bias"}};
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK(!t || (t->scalar_type() == qkv_weight.scalar_type() && t->device().is_cpu()),
                "layer ", l, "'s ", name, " is ", t->scalar_type(), " on ", t->device(),
                "; the stack's tensors must be ", qkv_weight.scalar_type(),
                " on the CPU, as its qkv_weight");
  }
  // Stand-ins of each linear's input, for packed_linear's checks of the weights.
  const auto opts = qkv_weight.options();
  const at::Tensor x = at::empty({1, hidden}, opts);
  const std::string norm = norm_ == NormKind::kLayerNorm ? "layer_norm" : "rms_norm";
  const auto checked = [&](const char* linear, const auto& check) {
    try {
      check();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "layer ", l, "'s ", linear, " linear: ", e.msg());
    }
  };
  checked("qkv", [&] {
    check_linear_inputs(x, qkv_weight, qkv_bias, "none", std::nullopt, norm, attn_norm_weight,
                        attn_norm_bias, norm_eps_);
  });
  checked("out", [&] {
    check_linear_inputs(at::empty({1, num_heads_ * head_dim_}, opts), out_weight, out_bias,
                        "none", x, "none", std::nullopt, std::nullopt, norm_eps_);
  });
  checked("up", [&] {
    check_linear_inputs(x, up_weight, up_bias, activation_name_, std::nullopt, norm,
                        mlp_norm_weight, mlp_norm_bias, norm_eps_);
  });
  const int64_t inter = act_ == Activation::kSiluAndMul ? up_weight.size(0) / 2 : up_weight.size(0);
  checked("down", [&] {
    check_linear_inputs(at::empty({1, inter}, opts), down_weight, down_bias, "none", x, "none",
                        std::nullopt, std::nullopt, norm_eps_);
  });
  const auto contiguous = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional(t->contiguous()) : std::nullopt;
  };
  push_layer({attn_norm_weight.contiguous(), qkv_weight.contiguous(), out_weight.contiguous(),
              mlp_norm_weight.contiguous(), up_weight.contiguous(), down_weight.contiguous(),
              contiguous(attn_norm_bias), contiguous(qkv_bias), contiguous(out_bias),
              contiguous(mlp_norm_bias), contiguous(up_bias), contiguous(down_bias), scale},
             qkv_weight.scalar_type(), hidden, inter);
}

void DecoderStack::add_quantized_layer(
    const at::Tensor& attn_norm_weight, const std::optional<at::Tensor>& attn_norm_bias,
    const at::Tensor& qkv_weight, const std::string& qkv_format,
    const std::optional<at::Tensor>& qkv_bias, const at::Tensor& out_weight,
    const std::string& out_format, const std::optional<at::Tensor>& out_bias,
    const at::Tensor& mlp_norm_weight, const std::optional<at::Tensor>& mlp_norm_bias,
    const at::Tensor& up_weight, const std::string& up_format,
    const std::optional<at::Tensor>& up_bias, const at::Tensor& down_weight,
    const std::string& down_format, const std::optional<at::Tensor>& down_bias, double scale) {
  const int64_t l = num_layers();
  check_dim(attn_norm_weight, "attn_norm_weight", 1, "[hidden]");
  TORCH_CHECK(attn_norm_weight.device().is_cpu(), "DecoderStack runs on the CPU; layer ", l,
              "'s attn_norm_weight is on ", attn_norm_weight.device());
  const at::ScalarType dtype = attn_norm_weight.scalar_type();
  const int64_t hidden = attn_norm_weight.size(0);
  TORCH_CHECK(l == 0 || (dtype == dtype_ && hidden == hidden_), "layer ", l,
              "'s attn_norm_weight is ", dtype, " ", shape_str(attn_norm_weight),
              "; the stack's layers are ", dtype_, ", ", hidden_, " wide");
  const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
  check_dim(qkv_weight, "qkv_weight", 2, "[(num_heads + 2 * num_kv_heads) * head_dim, bytes]");
  TORCH_CHECK(qkv_weight.size(0) == qkv_width, "layer ", l, "'s qkv_weight must have "
              "(num_heads + 2 * num_kv_heads) * head_dim = ", qkv_width, " rows, got shape ",
              shape_str(qkv_weight));
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a finite positive number, got ",
              scale, " for layer ", l);
  // Stand-ins of each linear's input, for quantized_linear's checks of the weights.
  const auto opts = attn_norm_weight.options();
  const at::Tensor x = at::empty({1, hidden}, opts);
  const std::string norm = norm_ == NormKind::kLayerNorm ? "layer_norm" : "rms_norm";
  std::optional<cpu::quant::Format> qkv, out, up, down;
  const auto checked = [&](const char* linear, std::optional<cpu::quant::Format>& format,
                           const auto& check) {
    try {
      format = check().format;
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "layer ", l, "'s ", linear, " linear: ", e.msg());
    }
  };
  checked("qkv", qkv, [&] {
    return check_quantized_linear_inputs(x, qkv_weight, qkv_format, hidden, qkv_bias, "none",
                                         std::nullopt, norm, attn_norm_weight, attn_norm_bias,
                                         norm_eps_);
  });
  checked("out", out, [&] {
    return check_quantized_linear_inputs(at::empty({1, num_heads_ * head_dim_}, opts), out_weight,
                                         out_format, num_heads_ * head_dim_, out_bias, "none", x,
                                         "none", std::nullopt, std::nullopt, norm_eps_);
  });
  checked("up", up, [&] {
    return check_quantized_linear_inputs(x, up_weight, up_format, hidden, up_bias,
                                         activation_name_, std::nullopt, norm, mlp_norm_weight,
                                         mlp_norm_bias, norm_eps_);
  });
  const int64_t inter = act_ == Activation::kSiluAndMul ? up_weight.size(0) / 2 : up_weight.size(0);
  checked("down", down, [&] {
    return check_quantized_linear_inputs(at::empty({1, inter}, opts), down_weight, down_format,
                                         inter, down_bias, "none", x, "none", std::nullopt,
                                         std::nullopt, norm_eps_);
  });
  const auto contiguous = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional(t->contiguous()) : std::nullopt;
  };
  Layer layer{attn_norm_weight.contiguous(), qkv_weight.contiguous(), out_weight.contiguous(),
              mlp_norm_weight.contiguous(), up_weight.contiguous(), down_weight.contiguous(),
              contiguous(attn_norm_bias), contiguous(qkv_bias), contiguous(out_bias),
              contiguous(mlp_norm_bias), contiguous(up_bias), contiguous(down_bias), scale};
  layer.qkv_format = qkv;
  layer.out_format = out;
  layer.up_format = up;
  layer.down_format = down;
  push_layer(std::move(layer), dtype, hidden, inter);
}

void DecoderStack::push_layer(Layer layer, at::ScalarType dtype, int64_t hidden, int64_t inter) {
  const int64_t l = num_layers();
  TORCH_CHECK(l == 0 || inter == inter_, "layer ", l, "'s MLP width ", inter,
              " differs from layer 0's ", inter_);
  if (l > 0) {
    const Layer& first = layers_[0];
    const std::pair<const std::optional<at::Tensor>*, const std::optional<at::Tensor>*> same[] = {
        {&layer.attn_norm_bias, &first.attn_norm_bias}, {&layer.qkv_bias, &first.qkv_bias},
        {&layer.out_bias, &first.out_bias}, {&layer.mlp_norm_bias, &first.mlp_norm_bias},
        {&layer.up_bias, &first.up_bias}, {&layer.down_bias, &first.down_bias}};
    for (const auto& [mine, theirs] : same) {
      TORCH_CHECK(mine->has_value() == theirs->has_value(), "layer ", l,
                  " has a different set of biases than layer 0 (every layer must have the same)");
    }
  }
  layers_.push_back(std::move(layer));
  dtype_ = dtype;
  hidden_ = hidden;
  inter_ = inter;
}

at::Tensor DecoderStack::forward(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                                 const std::vector<at::Tensor>& v_caches,
                                 const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                                 const at::Tensor& block_table, const at::Tensor& slot_mapping,
                                 const std::optional<at::Tensor>& rotary_cos,
                                 const std::optional<at::Tensor>& rotary_sin) const {
  return run(x, k_caches, v_caches, cu_q_lens, context_lens, block_table, slot_mapping,
             rotary_cos, rotary_sin, 0, 2 * num_layers(), true);
}

at::Tensor DecoderStack::forward_partial(
    const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
    const at::Tensor& context_lens, const at::Tensor& block_table,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, int64_t step, bool add_residual) const {
  TORCH_CHECK(step >= 0 && step < 2 * num_layers(), "step must be in [0, ", 2 * num_layers(),
              ") (2 per layer: attention, then MLP), got ", step);
  return run(x, k_caches, v_caches, cu_q_lens, context_lens, block_table, slot_mapping,
             rotary_cos, rotary_sin, step, step + 1, add_residual);
}

at::Tensor DecoderStack::run(const at::Tensor& x_in, const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches,
                             const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_table, const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& rotary_cos,
                             const std::optional<at::Tensor>& rotary_sin, int64_t step_begin,
                             int64_t step_end, bool add_residual) const {
  const int64_t L = num_layers();
  TORCH_CHECK(L > 0, "DecoderStack has no layers (add_layer first)");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "k_caches and v_caches must hold one cache per layer (", L, "), got ",
              k_caches.size(), " and ", v_caches.size());
  check_dim(x_in, "x", 2, "[T, hidden]");
  TORCH_CHECK(x_in.scalar_type() == dtype_ && x_in.device().is_cpu() && x_in.size(1) == hidden_,
              "x must be ", dtype_, " [T, ", hidden_, "] on the CPU as the stack's "
              "weights, got ", x_in.scalar_type(), " ", shape_str(x_in), " on ", x_in.device());
  const int64_t T = x_in.size(0);
  const int64_t most = max_tokens();
  TORCH_CHECK(T <= most, "DecoderStack runs up to ", most, " tokens a call, got ", T,
              " (run the model's own forward for more)");
  const StackShape s{T, hidden_, num_heads_, num_kv_heads_, head_dim_,
                     (num_heads_ + 2 * num_kv_heads_) * head_dim_, inter_, norm_, act_,
                     chosen_quant_isa(), chosen_attention_isa()};
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
              "rotary_cos and rotary_sin must be given together");
  if (rotary_cos) {
    for (const auto& [t, name] : {std::pair{&*rotary_cos, "rotary_cos"}, {&*rotary_sin,
                                                                          "rotary_sin"}}) {
      check_dim(*t, name, 2, "[T, head_dim / 2]");
      check_same_dtype(*t, name, x_in, "x");
      check_same_device(*t, name, x_in, "x");
      TORCH_CHECK(t->size(0) == T && 2 * t->size(1) == head_dim_, name, " must be [T, "
                  "head_dim / 2] = [", T, ", ", head_dim_ / 2, "], got ", shape_str(*t));
    }
  }
  // Stand-ins of the attention's inputs, for ragged_attention's and store_kv's checks.
  const at::Tensor q = at::empty({T, num_heads_, head_dim_}, x_in.options());
  const at::Tensor key = at::empty({T, num_kv_heads_, head_dim_}, x_in.options());
  const AttentionShape as = check_attention_inputs(q, k_caches[0], v_caches[0], cu_q_lens,
                                                   context_lens, block_table, layers_[0].scale);
  check_store_kv_inputs(key, key, k_caches[0], v_caches[0], slot_mapping);
  for (int64_t l = 1; l < L; ++l) {
    for (const at::Tensor* cache : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(cache->sizes() == k_caches[0].sizes() &&
                      cache->strides() == k_caches[0].strides() &&
                      cache->scalar_type() == x_in.scalar_type() && cache->device().is_cpu(),
                  "layer ", l, "'s KV cache is ", cache->scalar_type(), " ", shape_str(*cache),
                  " on ", cache->device(), "; every layer's must match layer 0's k_cache (",
                  k_caches[0].scalar_type(), " ", shape_str(k_caches[0]), " on ",
                  k_caches[0].device(), ")");
    }
  }
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK(slot < num_slots, "slot_mapping[", t, "] = ", slot,
                " is out of range for a cache of ", num_slots, " slots");
  }
  const at::Tensor cu = cu_q_lens.contiguous(), ctx = context_lens.contiguous(),
                   table = block_table.contiguous();
  check_metadata_values(as, cu.data_ptr<int32_t>(), ctx.data_ptr<int32_t>(),
                        table.data_ptr<int32_t>());
  at::Tensor x = x_in.contiguous().clone();
  if (T == 0) return x;
  const auto contiguous = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional(t->contiguous()) : std::nullopt;
  };
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "DecoderStack.forward", [&] {
    fused_stack<scalar_t>(x, s, layers_, k_caches, v_caches, cu, ctx, table, slots,
                          contiguous(rotary_cos), contiguous(rotary_sin), norm_eps_, step_begin,
                          step_end, add_residual);
  });
  return x;
}

}  // namespace orca
