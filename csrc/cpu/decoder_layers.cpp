// decoder_layers on CPU: a stack of pre-norm transformer blocks (GPT-2 and Llama shaped) in
// one call. Each block: qkv = linear(norm(x)); rotary on q and k; store_kv; attention;
// x += linear(attention); x += linear(act(linear(norm(x)))).
//
// Up to kSkinnyMaxT tokens (decode at small batch) the whole stack runs in ONE parallel region:
// each linear's blocks split across the threads as packed_linear's skinny path splits them,
// the attention's work items (the same plan for every layer) handed out dynamically, and a
// barrier wherever a step needs the previous one's whole output. Called op by op, each of a
// decode step's ~50 ops pays a dispatch, a fork-join and its output's allocation on caches the
// weight stream has evicted; one region pays them once. The kernels,
// their work split and their rounding are packed_linear's and ragged_attention's, so the
// results are the per-op blocks' bit for bit. More tokens run layer by layer through the ops.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <memory>

#include "attention_plan.h"
#include "orca/cpu/norm.h"
#include "skinny_blocks.h"

namespace orca {
namespace {

// One layer's tensors (biases and the norms' biases optional).
struct LayerWeights {
  const at::Tensor *attn_norm, *mlp_norm, *qkv, *out, *up, *down;
  std::optional<at::Tensor> attn_norm_bias, mlp_norm_bias, qkv_bias, out_bias, up_bias,
      down_bias;
  const at::Tensor *k_cache, *v_cache;
  double scale;
};

struct StackShape {
  int64_t T, hidden, num_heads, num_kv_heads, head_dim, qkv_width, inter;
  NormKind norm;
  Activation act;
};

// Validates every argument (through the per-op checks where one applies) and collects the
// layers.
StackShape check_stack(const at::Tensor& x, at::TensorList norm_weights,
                       at::TensorList norm_biases, at::TensorList weights,
                       const std::array<at::TensorList, 4>& biases, at::TensorList k_caches,
                       at::TensorList v_caches,
                       const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                       const at::Tensor& block_table, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& rotary_cos,
                       const std::optional<at::Tensor>& rotary_sin, c10::string_view norm,
                       double norm_eps, c10::string_view activation, int64_t num_heads,
                       int64_t num_kv_heads, at::ArrayRef<double> scales,
                       std::vector<LayerWeights>& layers) {
  const auto L = static_cast<int64_t>(k_caches.size());
  const auto check_len = [&](int64_t got, int64_t per_layer, const char* name) {
    TORCH_CHECK(got == per_layer * L, name, " must hold ", per_layer, " entries per layer (",
                per_layer * L, " for the ", L, " layers of k_caches), got ", got);
  };
  check_len(static_cast<int64_t>(v_caches.size()), 1, "v_caches");
  check_len(static_cast<int64_t>(norm_weights.size()), 2, "norm_weights");
  check_len(static_cast<int64_t>(weights.size()), 4, "weights");
  // Bias lists: empty (no such bias) or one per layer; norm_biases two.
  const auto check_optional_len = [&](at::TensorList list, int64_t per_layer, const char* name) {
    if (!list.empty()) check_len(static_cast<int64_t>(list.size()), per_layer, name);
  };
  check_optional_len(norm_biases, 2, "norm_biases (or empty)");
  for (int i = 0; i < 4; ++i) {
    const char* names[] = {"qkv_biases (or empty)", "out_biases (or empty)",
                           "up_biases (or empty)", "down_biases (or empty)"};
    check_optional_len(biases[i], 1, names[i]);
  }
  check_len(static_cast<int64_t>(scales.size()), 1, "scales");
  check_dim(x, "x", 2, "[T, hidden]");
  check_float_dtype(x, "x");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads (", num_heads, ") must be a positive multiple of num_kv_heads (",
              num_kv_heads, ")");
  StackShape s{x.size(0), x.size(1), num_heads, num_kv_heads, 0, 0, 0, parse_norm(norm),
               parse_activation(activation)};
  TORCH_CHECK(s.norm != NormKind::kNone, "decoder_layers needs a norm ('layer_norm' or "
              "'rms_norm'), got 'none'");
  if (L == 0) return s;
  s.head_dim = k_caches[0].dim() == 4 ? k_caches[0].size(3) : 0;
  s.qkv_width = (num_heads + 2 * num_kv_heads) * s.head_dim;
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
              "rotary_cos and rotary_sin must be given together");
  if (rotary_cos) {
    for (const auto& [t, name] : {std::pair{&*rotary_cos, "rotary_cos"}, {&*rotary_sin,
                                                                          "rotary_sin"}}) {
      check_dim(*t, name, 2, "[T, head_dim / 2]");
      check_same_dtype(*t, name, x, "x");
      check_same_device(*t, name, x, "x");
      TORCH_CHECK(t->size(0) == s.T && 2 * t->size(1) == s.head_dim, name, " must be [T, "
                  "head_dim / 2] = [", s.T, ", ", s.head_dim / 2, "], got ", shape_str(*t));
    }
  }
  // Stand-ins of each linear's input, for the per-op checks.
  const at::Tensor q = at::empty({s.T, num_heads, s.head_dim}, x.options());
  const at::Tensor attn = q.view({s.T, num_heads * s.head_dim});
  const at::Tensor key = at::empty({s.T, num_kv_heads, s.head_dim}, x.options());
  const AttentionShape as = check_attention_inputs(q, k_caches[0], v_caches[0], cu_q_lens,
                                                   context_lens, block_table, scales[0]);
  check_store_kv_inputs(key, key, k_caches[0], v_caches[0], slot_mapping);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK(slot < num_slots, "slot_mapping[", t, "] = ", slot,
                " is out of range for a cache of ", num_slots, " slots");
  }
  check_metadata_values(as, cu_q_lens.contiguous().data_ptr<int32_t>(),
                        context_lens.contiguous().data_ptr<int32_t>(),
                        block_table.contiguous().data_ptr<int32_t>());
  const auto act_name = std::string(activation);
  for (int64_t l = 0; l < L; ++l) {
    const auto entry = [](at::TensorList list, int64_t i) {
      return list.empty() ? std::nullopt : std::optional(list[i]);
    };
    LayerWeights w{&norm_weights[2 * l], &norm_weights[2 * l + 1], &weights[4 * l],
                   &weights[4 * l + 1], &weights[4 * l + 2], &weights[4 * l + 3],
                   entry(norm_biases, 2 * l), entry(norm_biases, 2 * l + 1),
                   entry(biases[0], l), entry(biases[1], l), entry(biases[2], l),
                   entry(biases[3], l), &k_caches[l], &v_caches[l], scales[l]};
    for (const auto* cache : {w.k_cache, w.v_cache}) {
      TORCH_CHECK(cache->sizes() == k_caches[0].sizes() && cache->strides() ==
                  k_caches[0].strides() && cache->scalar_type() == x.scalar_type() &&
                  cache->device() == x.device(), "layer ", l, "'s KV cache is ",
                  cache->scalar_type(), " ", shape_str(*cache), " on ", cache->device(),
                  "; every layer's must match layer 0's k_cache (", k_caches[0].scalar_type(),
                  " ", shape_str(k_caches[0]), " on ", k_caches[0].device(), ")");
    }
    TORCH_CHECK(std::isfinite(w.scale) && w.scale > 0,
                "scales must be finite positive numbers, got ", w.scale, " for layer ", l);
    TORCH_CHECK(w.qkv->dim() == 2 && w.qkv->size(0) == s.qkv_width, "layer ", l,
                "'s qkv weight must have (num_heads + 2 * num_kv_heads) * head_dim = ",
                s.qkv_width, " rows, got shape ", shape_str(*w.qkv));
    check_linear_inputs(x, *w.qkv, w.qkv_bias, "none", std::nullopt, norm, *w.attn_norm,
                        w.attn_norm_bias, norm_eps);
    check_linear_inputs(attn, *w.out, w.out_bias, "none", x, "none", std::nullopt,
                        std::nullopt, norm_eps);
    check_linear_inputs(x, *w.up, w.up_bias, act_name, std::nullopt, norm, *w.mlp_norm,
                        w.mlp_norm_bias, norm_eps);
    const int64_t inter = s.act == Activation::kSiluAndMul ? w.up->size(0) / 2 : w.up->size(0);
    TORCH_CHECK(l == 0 || inter == s.inter, "layer ", l, "'s MLP width ", inter,
                " differs from layer 0's ", s.inter);
    s.inter = inter;
    check_linear_inputs(at::empty({s.T, inter}, x.options()), *w.down, w.down_bias, "none", x,
                        "none", std::nullopt, std::nullopt, norm_eps);
    layers.push_back(w);
  }
  return s;
}

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

// This thread's blocks of a skinny linear, split as at::parallel_for splits packed_linear's.
template <typename scalar_t>
void linear_share(int64_t T, Activation act, const void* x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const scalar_t* residual,
                  scalar_t* out, int64_t N, int tid, int nth) {
  const int64_t K = weight.size(1);
  const int64_t blocks = ceil_div(N, kSkinnyBlock);
  const int64_t workers = std::min<int64_t>(nth, ceil_div(blocks, skinny_grain(K, act)));
  if (tid >= workers) return;
  const int64_t chunk = ceil_div(blocks, workers);
  const int64_t begin = tid * chunk, end = std::min(blocks, begin + chunk);
  if (begin >= end) return;
  const scalar_t* w = weight.data_ptr<scalar_t>();
  const scalar_t* b = bias ? bias->data_ptr<scalar_t>() : nullptr;
  dispatch_skinny(T, act, [&]<int kT, Activation a>() {
    skinny_blocks<kT, scalar_t, a>(x, w, K, N, b, residual, out, begin, end);
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
void fused_stack(at::Tensor& x, const StackShape& s, const std::vector<LayerWeights>& layers,
                 const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                 const at::Tensor& block_table, const at::Tensor& slot_mapping,
                 const std::optional<at::Tensor>& rotary_cos,
                 const std::optional<at::Tensor>& rotary_sin, double eps) {
  const int64_t T = s.T, H = s.hidden, D = s.head_dim;
  const int64_t L = static_cast<int64_t>(layers.size());
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const AttentionShape as{T, s.num_heads, s.num_kv_heads, D, layers[0].k_cache->size(0),
                          layers[0].k_cache->size(1), context_lens.size(0), block_table.size(1)};
  const Plan plan = make_plan(as, cu, ctx);
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
    for (int64_t l = 0; l < L; ++l) {
      const LayerWeights& w = layers[l];
      normalize(xp, s, *w.attn_norm, w.attn_norm_bias, eps, my_normed);
      linear_share<scalar_t>(T, Activation::kNone, kernel_input(my_normed, T * H, my_floats),
                             *w.qkv, w.qkv_bias, nullptr, qkv_p, s.qkv_width, tid, team);
#pragma omp barrier
      if (tid == 0) {
        if (rot_cos) {
          rotate_rows(qkv_p, 0, T, s.qkv_width, s.num_heads + s.num_kv_heads, D, rot_cos,
                      rot_sin);
        }
        store_rows(qkv_p, 0, T, s, slots, w.k_cache->data_ptr<scalar_t>(),
                   w.v_cache->data_ptr<scalar_t>());
      }
#pragma omp barrier
      const cpu::AttentionArgs<scalar_t> args{
          qkv_p, s.qkv_width, D, w.k_cache->data_ptr<scalar_t>(), w.v_cache->data_ptr<scalar_t>(),
          attn_p, cu, ctx, block_table.data_ptr<int32_t>(), as.max_blocks, as.block_size,
          s.num_heads, s.num_kv_heads, D, static_cast<float>(w.scale)};
      dispatch_head_dim(D, [&]<int kD>() {
        for (int64_t i = next[2 * l]++; i < items; i = next[2 * l]++) {
          cpu::attend<kD, kBf16Dot<scalar_t>>(args, plan.items[i], scratch, part);
        }
      });
      if (merges > 0) {
#pragma omp barrier
        for (int64_t i = next[2 * l + 1]++; i < merges; i = next[2 * l + 1]++) {
          cpu::merge_partials(args, plan.merges[i].first, plan.merges[i].second, part);
        }
      }
#pragma omp barrier
      linear_share<scalar_t>(T, Activation::kNone,
                             kernel_input(attn_p, T * s.num_heads * D, my_floats), *w.out,
                             w.out_bias, xp, xp, H, tid, team);
#pragma omp barrier
      normalize(xp, s, *w.mlp_norm, w.mlp_norm_bias, eps, my_normed);
      linear_share<scalar_t>(T, s.act, kernel_input(my_normed, T * H, my_floats), *w.up,
                             w.up_bias, nullptr, mid_p, s.inter, tid, team);
#pragma omp barrier
      linear_share<scalar_t>(T, Activation::kNone, kernel_input(mid_p, T * s.inter, my_floats),
                             *w.down, w.down_bias, xp, xp, H, tid, team);
#pragma omp barrier
    }
  }
}

// ---- More tokens: layer by layer through the orca ops.

void layered_stack(at::Tensor& x, const StackShape& s, const std::vector<LayerWeights>& layers,
                   const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                   const at::Tensor& block_table, const at::Tensor& slot_mapping,
                   const std::optional<at::Tensor>& rotary_cos,
                   const std::optional<at::Tensor>& rotary_sin, c10::string_view norm,
                   double eps, c10::string_view activation) {
  using Opt = const std::optional<at::Tensor>&;
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("orca::packed_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, Opt, c10::string_view, Opt,
                            c10::string_view, Opt, Opt, double)>();
  static const auto store_kv =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("orca::store_kv", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                      const at::Tensor&)>();
  static const auto attention =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("orca::ragged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  const int64_t T = s.T, D = s.head_dim;
  const int64_t q_width = s.num_heads * D, kv_width = s.num_kv_heads * D;
  for (const LayerWeights& w : layers) {
    at::Tensor qkv = linear.call(x, *w.qkv, w.qkv_bias, "none", std::nullopt, norm,
                                 *w.attn_norm, w.attn_norm_bias, eps);
    if (rotary_cos) {
      ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "decoder_layers", [&] {
        at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
          rotate_rows(qkv.data_ptr<scalar_t>(), begin, end, s.qkv_width,
                      s.num_heads + s.num_kv_heads, D, rotary_cos->data_ptr<scalar_t>(),
                      rotary_sin->data_ptr<scalar_t>());
        });
      });
    }
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, s.num_heads, D});
    const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({T, s.num_kv_heads, D});
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({T, s.num_kv_heads, D});
    at::Tensor k_cache = *w.k_cache, v_cache = *w.v_cache;
    store_kv.call(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attn = attention.call(q, k_cache, v_cache, cu_q_lens, context_lens,
                                           block_table, w.scale);
    x = linear.call(attn.view({T, q_width}), *w.out, w.out_bias, "none", x, "none",
                    std::nullopt, std::nullopt, eps);
    const at::Tensor mid = linear.call(x, *w.up, w.up_bias, activation, std::nullopt, norm,
                                       *w.mlp_norm, w.mlp_norm_bias, eps);
    x = linear.call(mid, *w.down, w.down_bias, "none", x, "none", std::nullopt, std::nullopt,
                    eps);
  }
}

at::Tensor decoder_layers_cpu(
    const at::Tensor& x_in, at::TensorList norm_weights, at::TensorList norm_biases,
    at::TensorList weights, at::TensorList qkv_biases, at::TensorList out_biases,
    at::TensorList up_biases, at::TensorList down_biases, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
    const at::Tensor& block_table, const at::Tensor& slot_mapping,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
    c10::string_view norm, double norm_eps, c10::string_view activation, int64_t num_heads,
    int64_t num_kv_heads, at::ArrayRef<double> scales) {
  std::vector<LayerWeights> layers;
  const StackShape s = check_stack(x_in, norm_weights, norm_biases, weights,
                                   {qkv_biases, out_biases, up_biases, down_biases}, k_caches,
                                   v_caches, cu_q_lens, context_lens, block_table, slot_mapping,
                                   rotary_cos, rotary_sin, norm, norm_eps, activation,
                                   num_heads, num_kv_heads, scales, layers);
  at::Tensor x = x_in.contiguous().clone();
  if (layers.empty() || s.T == 0) return x;
  const auto contiguous = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional(t->contiguous()) : std::nullopt;
  };
  const std::optional<at::Tensor> cos = contiguous(rotary_cos), sin = contiguous(rotary_sin);
  if (s.T > kSkinnyMaxT) {
    layered_stack(x, s, layers, cu_q_lens, context_lens, block_table, slot_mapping, cos, sin,
                  norm, norm_eps, activation);
    return x;
  }
  for (LayerWeights& w : layers) {
    for (auto* b : {&w.attn_norm_bias, &w.mlp_norm_bias, &w.qkv_bias, &w.out_bias, &w.up_bias,
                    &w.down_bias}) {
      *b = contiguous(*b);
    }
  }
  std::vector<at::Tensor> owned;  // contiguous copies of any strided weights
  owned.reserve(6 * layers.size());  // never reallocated: the layers point into it
  for (LayerWeights& w : layers) {
    for (const at::Tensor** t : {&w.attn_norm, &w.mlp_norm, &w.qkv, &w.out, &w.up, &w.down}) {
      if (!(*t)->is_contiguous()) {
        owned.push_back((*t)->contiguous());
        *t = &owned.back();
      }
    }
  }
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "decoder_layers", [&] {
    fused_stack<scalar_t>(x, s, layers, cu_q_lens.contiguous(), context_lens.contiguous(),
                          block_table.contiguous(), slot_mapping.contiguous(), cos, sin,
                          norm_eps);
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("decoder_layers", &decoder_layers_cpu); }

}  // namespace orca
