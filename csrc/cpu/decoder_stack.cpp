// DecoderStack on CPU: a model's decoder blocks (orca_ext/model/decoder.py's block) in one call.
// Each block: qkv = linear(norm(x)); QK norms; rotary on q and k; store_kv; attention (within
// the layer's window); x += [post_norm](linear(attention)); x += [post_norm](linear(act(linear(
// norm(x))))).
//
// Up to kSkinnyMaxT tokens (decode at small batch; kQuantStackMaxT for q8_0 / q4_0 / q4_1
// blocks, whose tile kernels take any number of tokens, on amx_int8) the whole stack runs in ONE
// parallel region: each linear's blocks split across the threads as packed_linear's skinny path
// splits them, the attention's work items (one plan per distinct window, shared by the layers)
// handed out dynamically, and a barrier wherever a step needs the previous one's whole output,
// so a step pays one dispatch and one fork-join instead of one per op. The kernels, their work split and
// their rounding are packed_linear's, rms_norm's and ragged_attention's, so the results are the
// per-op blocks' bit for bit.
#include "decoder_stack.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <memory>

#include "attention_plan.h"
#include "orca/cpu/lora.h"
#include "orca/cpu/math.h"
#include "orca/cpu/norm.h"
#include "normalized_input.h"
#include "quant_blocks.h"
#include "skinny_blocks.h"

namespace orca {

namespace {

// The most tokens a stack of quantized layers takes a call (its linears' y scratch).
constexpr int64_t kQuantStackMaxT = 64;

struct StackShape {
  int64_t T, hidden, num_heads, num_kv_heads, head_dim, qkv_width, inter;
  NormKind norm;
  Activation act;
  cpu::quant::Isa isa;  // the quantized linears' kernels (quant_isa_choice, once per call)
  cpu::AttentionIsa attention_isa;  // the attention's (attention_isa_choice, once per call)
};

// The first `rot` dims of the q and k heads of qkv rows [T, stride] rotated in place (neox
// rotate-half over those dims), by cos / sin [T, rot / 2]: (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin). Each product and sum is rounded to scalar_t as the models' apply_rotary
// (torch ops) rounds it, so the results are the same bits; `volatile` keeps the compiler from
// fusing them into FMAs.
template <typename scalar_t>
void rotate_rows(scalar_t* qkv, int64_t begin, int64_t end, int64_t stride, int64_t heads,
                 int64_t D, int64_t rot, const scalar_t* cos, const scalar_t* sin) {
  const int64_t half = rot / 2;
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

// Rows [begin, end) of the k / v heads in qkv written into their cache slots (negative: none):
// copied, or quantized per (token, head) into an int8 cache's rows.
template <typename scalar_t>
void store_rows(const scalar_t* qkv, int64_t begin, int64_t end, const StackShape& s,
                const int64_t* slots, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t H = s.num_kv_heads, D = s.head_dim, width = H * D;
  const int64_t k_off = s.num_heads * D, v_off = k_off + width;
  const bool int8_cache = is_int8_kv_cache(k_cache);
  for (int64_t t = begin; t < end; ++t) {
    if (slots[t] < 0) continue;
    const scalar_t* k = qkv + t * s.qkv_width + k_off;
    const scalar_t* v = qkv + t * s.qkv_width + v_off;
    if (int8_cache) {
      const int64_t row_bytes = D + cpu::kInt8ScaleBytes;
      int8_t* k_rows = k_cache.data_ptr<int8_t>() + slots[t] * H * row_bytes;
      int8_t* v_rows = v_cache.data_ptr<int8_t>() + slots[t] * H * row_bytes;
      for (int64_t h = 0; h < H; ++h) {
        cpu::quantize_kv_row(k + h * D, D, k_rows + h * row_bytes, true);
        cpu::quantize_kv_row(v + h * D, D, v_rows + h * row_bytes, false);
      }
    } else {
      std::memcpy(k_cache.data_ptr<scalar_t>() + slots[t] * width, k, width * sizeof(scalar_t));
      std::memcpy(v_cache.data_ptr<scalar_t>() + slots[t] * width, v, width * sizeof(scalar_t));
    }
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

// One linear of the stack: its input rows [T, K], its weights, its epilogue's residual, and
// its output [T, N].
template <typename scalar_t>
struct LinearStep {
  const scalar_t* rows;
  int64_t K;
  const DecoderStack::Linear& linear;
  const scalar_t* residual;
  scalar_t* out;
  int64_t N;
};

// [begin, end): thread tid's share of `units` split as at::parallel_for splits them with `grain`.
struct Share {
  int64_t begin, end;
};
inline Share parallel_share(int64_t units, int64_t grain, int tid, int nth) {
  const int64_t workers = std::min<int64_t>(nth, ceil_div(units, grain));
  if (tid >= workers) return {0, 0};
  const int64_t chunk = ceil_div(units, workers);
  return {std::min(units, tid * chunk), std::min(units, (tid + 1) * chunk)};
}

// This thread's share of a skinny linear, split as at::parallel_for splits quantized_linear's
// (its dot path's groups of kRowGroup columns) or packed_linear's (blocks of kSkinnyBlock).
// floats (T * K) and int8 (the int8 activations' bytes) are this thread's scratch.
template <typename scalar_t>
void linear_share(const StackShape& s, Activation act, const LinearStep<scalar_t>& step,
                  float* floats, uint8_t* int8, int tid, int nth) {
  const int64_t T = s.T, K = step.K, N = step.N;
  const Share share =
      step.linear.format
          ? parallel_share(ceil_div(N, cpu::quant::kRowGroup), quant_group_grain(K, act), tid, nth)
          : parallel_share(ceil_div(N, kSkinnyBlock), skinny_grain(K, act), tid, nth);
  const int64_t begin = share.begin, end = share.end;
  if (begin >= end) return;
  const auto& bias = step.linear.bias;
  const scalar_t* b = bias ? bias->template data_ptr<scalar_t>() : nullptr;
  if (step.linear.format) {
    // As quantized_linear: the rows as float32, split into int8 parts for the int8 kernels.
    for (int64_t i = 0; i < T * K; ++i) floats[i] = static_cast<float>(step.rows[i]);
    const QuantLayout format = *step.linear.format;
    const Int8Path path = int8_path(s.isa, format, T, true);
    quantize_for(path, format.format, floats, T, K, int8);
    float y[2][kQuantStackMaxT * kSkinnyBlock];
    dispatch_activation(act, [&]<Activation a>() {
      quant_dot_groups<scalar_t, a>(s.isa, format, floats, path, int8, T, K,
                                    step.linear.weight.template data_ptr<uint8_t>(), b,
                                    step.residual, step.out, N, begin, end, y[0], y[1]);
    });
    return;
  }
  const void* x = kernel_input(step.rows, T * K, floats);
  const scalar_t* w = step.linear.weight.template data_ptr<scalar_t>();
  dispatch_skinny(T, act, [&]<int kT, Activation a>() {
    skinny_blocks<kT, scalar_t, a>(x, w, K, N, b, step.residual, step.out, begin, end);
  });
}

// A step's LoRA: each row's adapter slot (-1: none), the slots' scales, the layers' slots.
struct StepLora {
  const int32_t* row_slot;  // [T]
  const float* scales;
  const std::vector<std::array<DecoderStack::LoraPair, 4>>& pairs;
  cpu::lora::Isa isa;
};
enum LoraLinear { kLoraQkv = 0, kLoraOut = 1, kLoraUp = 2, kLoraDown = 3 };

// This thread's columns [N * tid / nth, N * (tid + 1) / nth) of y [T, N] plus each adapter row's
// delta from rows [T, K] (as ops.lora_linear: float32 sums, rounded once into y); every thread
// computes the rows' shrinks (R * K each) itself, the rows of one slot together (its A and B
// read once). floats: T * (K + R + N) of scratch.
template <typename scalar_t>
void lora_share(const StepLora& lora, const DecoderStack::LoraPair& pair, int64_t T,
                const scalar_t* rows, int64_t K, scalar_t* y, int64_t N, float* floats, int tid,
                int nth) {
  const int64_t n0 = N * tid / nth, n1 = N * (tid + 1) / nth, R = pair.a.size(1);
  if (n0 >= n1) return;
  const int64_t width = n1 - n0;
  float* x = floats;             // [T, K]
  float* acc = x + T * K;        // [T, width]
  float* shrink = acc + T * width;  // [T, R]
  const float* a = pair.a.data_ptr<float>();
  const float* b = pair.b.data_ptr<float>();
  std::vector<const float*> xs;
  std::vector<float*> ys;
  xs.reserve(T);
  ys.reserve(T);
  static_assert(kQuantStackMaxT <= 64, "one bit per row");
  uint64_t done = 0;  // rows handled
  for (int64_t t = 0; t < T; ++t) {
    const int32_t slot = lora.row_slot[t];
    if (slot < 0 || (done >> t & 1)) continue;
    xs.clear();
    ys.clear();
    for (int64_t u = t; u < T; ++u) {
      if (lora.row_slot[u] != slot) continue;
      done |= uint64_t{1} << u;
      for (int64_t k = 0; k < K; ++k) x[u * K + k] = static_cast<float>(rows[u * K + k]);
      for (int64_t n = n0; n < n1; ++n) {
        acc[u * width + n - n0] = static_cast<float>(y[u * N + n]);
      }
      xs.push_back(x + u * K);
      ys.push_back(acc + u * width);
    }
    cpu::lora::add_rows_delta(lora.isa, xs.data(), static_cast<int64_t>(xs.size()), K,
                              a + slot * R * K, R, b + slot * R * N + n0, N, width,
                              lora.scales[slot], shrink, ys.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    if (lora.row_slot[t] < 0) continue;
    for (int64_t n = n0; n < n1; ++n) {
      y[t * N + n] = static_cast<scalar_t>(acc[t * width + n - n0]);
    }
  }
}

// This thread's columns of mid [T, I] = act(pre) (a gated act: act(pre[:, :I]) * pre[:, I:]),
// the up linear's epilogue run after its LoRA delta.
template <typename scalar_t>
void activation_share(Activation act, const scalar_t* pre, int64_t T, int64_t I, scalar_t* mid,
                      int tid, int nth) {
  const int64_t i0 = I * tid / nth, i1 = I * (tid + 1) / nth;
  const bool gated = is_gated(act);
  const int64_t width = gated ? 2 * I : I;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = i0; i < i1; ++i) {
      const float g = static_cast<float>(pre[t * width + i]);
      float v;
      if (act == Activation::kSiluAndMul || act == Activation::kGeluTanhAndMul) {
        const float gate = static_cast<float>(static_cast<scalar_t>(
            act == Activation::kSiluAndMul ? cpu::silu(g) : cpu::gelu_tanh(g)));
        v = gate * static_cast<float>(pre[t * width + I + i]);
      } else {
        v = act == Activation::kGeluTanh ? cpu::gelu_tanh(g)
            : act == Activation::kRelu   ? std::max(g, 0.f)
                                         : g;
      }
      mid[t * I + i] = static_cast<scalar_t>(v);
    }
  }
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

// Rows [T * tid / nth, T * (tid + 1) / nth) of x += rms_norm(h) (a post norm's add); each row's
// result does not depend on the split (rms_norm's rows).
template <typename scalar_t>
void post_norm_share(scalar_t* x, const scalar_t* h, const StackShape& s, const at::Tensor& weight,
                     double eps, int tid, int nth) {
  const int64_t begin = s.T * tid / nth, end = s.T * (tid + 1) / nth;
  cpu::rms_norm_rows(h + begin * s.hidden, end - begin, s.hidden, weight.data_ptr<scalar_t>(),
                     static_cast<float>(eps), x + begin * s.hidden, x + begin * s.hidden);
}

// The step's arguments that every layer shares.
template <typename scalar_t>
struct StepArgs {
  const std::vector<at::Tensor>& k_caches;
  const std::vector<at::Tensor>& v_caches;
  const int32_t* cu;
  const int32_t* ctx;
  const int32_t* block_table;
  const int64_t* slots;
  const scalar_t* rot_cos;  // [R, T, rotary_dim / 2], or null
  const scalar_t* rot_sin;
  int64_t rotary_dim;
};

template <typename scalar_t>
void fused_stack(at::Tensor& x, const StackShape& s, const std::vector<DecoderStack::Layer>& layers,
                 const StepArgs<scalar_t>& a, const AttentionShape& as, double eps,
                 int64_t step_begin, int64_t step_end, bool add_residual, bool partial,
                 const StepLora* lora) {
  const int64_t T = s.T, H = s.hidden, D = s.head_dim;
  const int64_t L = static_cast<int64_t>(layers.size());
  // One attention plan per distinct window among the layers run.
  const bool wide = std::is_same_v<scalar_t, c10::BFloat16> && !is_int8_kv_cache(a.k_caches[0]) &&
                    cpu::amx_head_dim(s.attention_isa, D);
  std::vector<int64_t> windows;
  std::vector<int64_t> plan_of(L, 0);
  for (int64_t l = step_begin / 2; l < (step_end + 1) / 2; ++l) {
    const auto it = std::find(windows.begin(), windows.end(), layers[l].window);
    plan_of[l] = it - windows.begin();
    if (it == windows.end()) windows.push_back(layers[l].window);
  }
  std::vector<Plan> plans;
  int64_t partial_rows = 0;
  for (const int64_t window : windows) {
    plans.push_back(make_plan(as, a.cu, a.ctx, wide, window));
    partial_rows = std::max(partial_rows, plans.back().partial_rows);
  }
  const auto opts = x.options();
  const int64_t widest = std::max({H, s.num_heads * D, s.inter});
  const int nth = at::in_parallel_region() ? 1 : at::get_num_threads();
  const bool post_norms = layers[0].post_attn_norm.has_value();
  // Shared between the threads: the projections, the attention output, the MLP's middle and a
  // post-norm block's linear outputs; each thread's own: a normalized input and its float32 copy
  // for the kernel.
  at::Tensor qkv = at::empty({T, s.qkv_width}, opts), attn = at::empty({T, s.num_heads * D}, opts),
             mid = at::empty({T, s.inter}, opts);
  at::Tensor projected = post_norms && !partial ? at::empty({T, H}, opts) : at::Tensor();
  at::Tensor normed = at::empty({nth, T * H}, opts);
  at::Tensor floats = at::empty({nth, T * widest}, opts.dtype(at::kFloat));
  const int64_t int8_bytes = std::max(cpu::quant::int8_activation_bytes(T, widest),
                                      cpu::quant::amx_activation_bytes(T, widest));
  at::Tensor int8 = at::empty({nth, int8_bytes}, opts.dtype(at::kByte));
  // LoRA: the up linear's pre-activation rows, and each thread's delta scratch.
  const int64_t up_width = is_gated(s.act) ? 2 * s.inter : s.inter;
  at::Tensor pre = lora ? at::empty({T, up_width}, opts) : at::Tensor();
  const int64_t lora_floats =
      lora ? T * (widest + std::max({s.qkv_width, H, up_width}) +
                  lora->pairs[0][kLoraQkv].a.size(1)) : 0;
  at::Tensor lora_scratch = at::empty({nth, lora_floats}, opts.dtype(at::kFloat));
  at::Tensor part_o = at::empty({partial_rows, D}, opts.dtype(at::kFloat));
  at::Tensor part_ml = at::empty({2, partial_rows}, opts.dtype(at::kFloat));
  const cpu::Partials part{part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                           part_ml.data_ptr<float>() + partial_rows};
  // Per layer: the next attention item and merge to hand out.
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[2 * L]);
  for (int64_t i = 0; i < 2 * L; ++i) next[i] = 0;
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* qkv_p = qkv.data_ptr<scalar_t>();
  scalar_t* attn_p = attn.data_ptr<scalar_t>();
  scalar_t* mid_p = mid.data_ptr<scalar_t>();
  // Where a half-layer's last linear writes: x itself (with the residual, or a tensor-parallel
  // rank's partial sum), or a buffer that the post norm then adds to x.
  scalar_t* sum_p = projected.defined() ? projected.template data_ptr<scalar_t>() : xp;
  scalar_t* residual = add_residual && !post_norms ? xp : nullptr;
  const int64_t half_rot = a.rotary_dim / 2;

  at::internal::lazy_init_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    const c10::ParallelGuard guard(true);
    thread_local cpu::AttentionScratch scratch;
    scalar_t* my_normed = normed.data_ptr<scalar_t>() + tid * T * H;
    float* my_floats = floats.data_ptr<float>() + tid * T * widest;
    uint8_t* my_int8 = int8.data_ptr<uint8_t>() + tid * int8_bytes;
    float* my_lora = lora_scratch.data_ptr<float>() + tid * lora_floats;
    // Step 2l is layer l's attention half, 2l + 1 its MLP half.
    for (int64_t step = step_begin; step < step_end; ++step) {
      const int64_t l = step / 2;
      const DecoderStack::Layer& w = layers[l];
      if (step % 2 == 1) {
        normalize(xp, s, w.mlp_norm, w.mlp_norm_bias, eps, my_normed);
        if (lora) {  // the delta goes in before the activation
          scalar_t* pre_p = pre.data_ptr<scalar_t>();
          linear_share<scalar_t>(s, Activation::kNone, {my_normed, H, w.up, nullptr, pre_p,
                                                        up_width}, my_floats, my_int8, tid, team);
#pragma omp barrier
          lora_share(*lora, lora->pairs[l][kLoraUp], T, my_normed, H, pre_p, up_width, my_lora,
                     tid, team);
#pragma omp barrier
          activation_share(s.act, pre_p, T, s.inter, mid_p, tid, team);
        } else {
          linear_share<scalar_t>(s, s.act, {my_normed, H, w.up, nullptr, mid_p, s.inter},
                                 my_floats, my_int8, tid, team);
        }
#pragma omp barrier
        linear_share<scalar_t>(s, Activation::kNone, {mid_p, s.inter, w.down, residual, sum_p, H},
                               my_floats, my_int8, tid, team);
#pragma omp barrier
        if (lora) {
          lora_share(*lora, lora->pairs[l][kLoraDown], T, mid_p, s.inter, sum_p, H, my_lora, tid,
                     team);
#pragma omp barrier
        }
        if (projected.defined()) {
          post_norm_share(xp, sum_p, s, *w.post_mlp_norm, eps, tid, team);
#pragma omp barrier
        }
        continue;
      }
      normalize(xp, s, w.attn_norm, w.attn_norm_bias, eps, my_normed);
      linear_share<scalar_t>(s, Activation::kNone, {my_normed, H, w.qkv, nullptr, qkv_p,
                                                    s.qkv_width}, my_floats, my_int8, tid, team);
#pragma omp barrier
      if (lora) {
        lora_share(*lora, lora->pairs[l][kLoraQkv], T, my_normed, H, qkv_p, s.qkv_width, my_lora,
                   tid, team);
#pragma omp barrier
      }
      if (tid == 0) {
        if (w.q_norm) {
          const auto e = static_cast<float>(eps);
          for (int64_t t = 0; t < T; ++t) {
            scalar_t* q = qkv_p + t * s.qkv_width;
            scalar_t* k = q + s.num_heads * D;
            cpu::rms_norm_rows(q, s.num_heads, D, w.q_norm->data_ptr<scalar_t>(), e, q);
            cpu::rms_norm_rows(k, s.num_kv_heads, D, w.k_norm->data_ptr<scalar_t>(), e, k);
          }
        }
        if (a.rot_cos) {
          const int64_t table = w.rotary * T * half_rot;
          rotate_rows(qkv_p, 0, T, s.qkv_width, s.num_heads + s.num_kv_heads, D, a.rotary_dim,
                      a.rot_cos + table, a.rot_sin + table);
        }
        store_rows(qkv_p, 0, T, s, a.slots, a.k_caches[l], a.v_caches[l]);
      }
#pragma omp barrier
      const Plan& plan = plans[plan_of[l]];
      const auto items = static_cast<int64_t>(plan.items.size());
      const auto merges = static_cast<int64_t>(plan.merges.size());
      const bool int8_cache = is_int8_kv_cache(a.k_caches[l]);
      cpu::AttentionArgs<scalar_t> args{
          qkv_p, s.qkv_width, D,
          int8_cache ? nullptr : a.k_caches[l].template data_ptr<scalar_t>(),
          int8_cache ? nullptr : a.v_caches[l].template data_ptr<scalar_t>(), attn_p, a.cu,
          a.ctx, a.block_table, as.max_blocks, as.block_size, s.num_heads, s.num_kv_heads, D,
          static_cast<float>(w.scale), w.window};
      if (int8_cache) {
        args.k_int8 = a.k_caches[l].template data_ptr<int8_t>();
        args.v_int8 = a.v_caches[l].template data_ptr<int8_t>();
      }
      dispatch_attention_kernels<scalar_t>(
          s.attention_isa, int8_cache, [&]<cpu::AttentionIsa kIsa, bool kInt8>() {
            dispatch_head_dim(D, [&]<int kD>() {
              for (int64_t i = next[2 * l]++; i < items; i = next[2 * l]++) {
                cpu::attend<kD, kIsa, kInt8>(args, plan.items[i], scratch, part);
              }
            });
          });
      if (merges > 0) {
#pragma omp barrier
        for (int64_t i = next[2 * l + 1]++; i < merges; i = next[2 * l + 1]++) {
          cpu::merge_partials(args, plan.merges[i].first, plan.merges[i].num_splits, part);
        }
      }
#pragma omp barrier
      linear_share<scalar_t>(s, Activation::kNone, {attn_p, s.num_heads * D, w.out, residual,
                                                    sum_p, H}, my_floats, my_int8, tid, team);
#pragma omp barrier
      if (lora) {
        lora_share(*lora, lora->pairs[l][kLoraOut], T, attn_p, s.num_heads * D, sum_p, H,
                   my_lora, tid, team);
#pragma omp barrier
      }
      if (projected.defined()) {
        post_norm_share(xp, sum_p, s, *w.post_attn_norm, eps, tid, team);
#pragma omp barrier
      }
    }
  }
}

// The tensor named `name` in `weights`, if given.
std::optional<at::Tensor> optional_weight(const c10::Dict<std::string, at::Tensor>& weights,
                                          const std::string& name) {
  const auto it = weights.find(name);
  return it == weights.end() ? std::nullopt : std::optional(it->value());
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t ? std::optional(t->contiguous()) : std::nullopt;
}

constexpr const char* kWeightNames[] = {
    "attn_norm", "attn_norm_bias", "qkv",      "qkv_bias", "q_norm",         "k_norm",
    "out",       "out_bias",       "post_attn_norm",       "mlp_norm",       "mlp_norm_bias",
    "up",        "up_bias",        "down",     "down_bias", "post_mlp_norm"};

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
  const auto quantized_linear = [](const Linear& linear) { return linear.format.has_value(); };
  const bool quantized =
      !layers_.empty() && std::all_of(layers_.begin(), layers_.end(), [&](const Layer& l) {
        return quantized_linear(l.qkv) && quantized_linear(l.out) && quantized_linear(l.up) &&
               quantized_linear(l.down);
      });
  return quantized && quant_isa_choice().get() == cpu::quant::Isa::kAmxInt8 ? kQuantStackMaxT
                                                                          : kSkinnyMaxT;
}

void DecoderStack::add_layer(const c10::Dict<std::string, at::Tensor>& weights,
                             const c10::Dict<std::string, std::string>& formats, double scale,
                             int64_t window, int64_t rotary) {
  const int64_t l = num_layers();
  for (const auto& entry : weights) {
    const std::string& name = entry.key();
    TORCH_CHECK(std::find(std::begin(kWeightNames), std::end(kWeightNames), name) !=
                    std::end(kWeightNames),
                "layer ", l, ": unknown weight '", name, "' (known: attn_norm, attn_norm_bias, "
                "qkv, qkv_bias, q_norm, k_norm, out, out_bias, post_attn_norm, mlp_norm, "
                "mlp_norm_bias, up, up_bias, down, down_bias, post_mlp_norm)");
  }
  for (const auto& entry : formats) {
    const std::string& name = entry.key();
    TORCH_CHECK(name == "qkv" || name == "out" || name == "up" || name == "down", "layer ", l,
                ": formats names '", name, "', not one of the linears qkv, out, up, down");
  }
  const auto required = [&](const char* name) {
    const auto t = optional_weight(weights, name);
    TORCH_CHECK(t.has_value(), "layer ", l, " lacks the weight '", name, "'");
    return *t;
  };
  const at::Tensor attn_norm = required("attn_norm");
  check_dim(attn_norm, "attn_norm", 1, "[hidden]");
  TORCH_CHECK(attn_norm.device().is_cpu(), "DecoderStack runs on the CPU; layer ", l,
              "'s attn_norm is on ", attn_norm.device());
  const at::ScalarType dtype = attn_norm.scalar_type();
  const int64_t hidden = attn_norm.size(0);
  TORCH_CHECK(l == 0 || (dtype == dtype_ && hidden == hidden_), "layer ", l, "'s attn_norm is ",
              dtype, " ", shape_str(attn_norm), "; the stack's layers are ", dtype_, ", ", hidden_,
              " wide");
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a finite positive number, got ",
              scale, " for layer ", l);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window, " for layer ", l);
  TORCH_CHECK(rotary >= 0, "rotary must be >= 0 (a rotary table's index), got ", rotary,
              " for layer ", l);
  for (const auto& entry : weights) {
    const at::Tensor& t = entry.value();
    const bool blocks = formats.contains(entry.key());
    TORCH_CHECK(t.device().is_cpu() && (blocks || t.scalar_type() == dtype), "layer ", l, "'s ",
                entry.key(), " is ", t.scalar_type(), " on ", t.device(), "; the stack's tensors "
                "must be ", dtype, " (GGUF blocks: uint8) on the CPU, as its attn_norm");
  }
  const std::string norm = norm_ == NormKind::kLayerNorm ? "layer_norm" : "rms_norm";
  const auto opts = attn_norm.options();
  const at::Tensor x = at::empty({1, hidden}, opts);
  // A linear checked as packed_linear or quantized_linear checks it, given stand-ins of its
  // input and residual.
  const auto linear = [&](const char* name, int64_t in_features, const std::string& activation,
                          const std::optional<at::Tensor>& residual, c10::string_view in_norm,
                          const std::optional<at::Tensor>& norm_weight,
                          const std::optional<at::Tensor>& norm_bias) {
    Linear out{required(name), optional_weight(weights, std::string(name) + "_bias"),
               std::nullopt};
    const at::Tensor input = at::empty({1, in_features}, opts);
    try {
      if (formats.contains(name)) {
        out.format = check_quantized_linear_inputs(input, out.weight, formats.at(name),
                                                   in_features, out.bias, activation, residual,
                                                   in_norm, norm_weight, norm_bias, norm_eps_)
                         .layout;
      } else {
        check_linear_inputs(input, out.weight, out.bias, activation, residual, in_norm,
                            norm_weight, norm_bias, norm_eps_);
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "layer ", l, "'s ", name, " linear: ", e.msg());
    }
    out.weight = out.weight.contiguous();
    out.bias = contiguous(out.bias);
    return out;
  };
  const auto attn_norm_bias = optional_weight(weights, "attn_norm_bias");
  const auto mlp_norm = required("mlp_norm");
  const auto mlp_norm_bias = optional_weight(weights, "mlp_norm_bias");
  Linear qkv = linear("qkv", hidden, "none", std::nullopt, norm, attn_norm, attn_norm_bias);
  const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
  TORCH_CHECK(qkv.weight.size(0) == qkv_width, "layer ", l, "'s qkv must have (num_heads + 2 * "
              "num_kv_heads) * head_dim = ", qkv_width, " rows, got shape ",
              shape_str(qkv.weight));
  Linear out = linear("out", num_heads_ * head_dim_, "none", x, "none", std::nullopt,
                      std::nullopt);
  Linear up = linear("up", hidden, activation_name_, std::nullopt, norm, mlp_norm, mlp_norm_bias);
  const int64_t inter = is_gated(act_) ? up.weight.size(0) / 2 : up.weight.size(0);
  Linear down = linear("down", inter, "none", x, "none", std::nullopt, std::nullopt);
  // The RMSNorms of q / k heads and of the attention / MLP outputs, checked as rms_norm checks.
  const auto rms_weight = [&](const char* name, int64_t width) {
    const auto w = optional_weight(weights, name);
    if (w) {
      try {
        check_rms_norm_inputs(at::empty({1, width}, opts), *w, norm_eps_, std::nullopt);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "layer ", l, "'s ", name, ": ", e.msg());
      }
    }
    return contiguous(w);
  };
  Layer layer{attn_norm.contiguous(), mlp_norm.contiguous(), contiguous(attn_norm_bias),
              contiguous(mlp_norm_bias), rms_weight("q_norm", head_dim_),
              rms_weight("k_norm", head_dim_), rms_weight("post_attn_norm", hidden),
              rms_weight("post_mlp_norm", hidden), std::move(qkv), std::move(out), std::move(up),
              std::move(down), scale, window, rotary};
  TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "layer ", l,
              " has only one of q_norm and k_norm (give both or neither)");
  TORCH_CHECK(layer.post_attn_norm.has_value() == layer.post_mlp_norm.has_value(), "layer ", l,
              " has only one of post_attn_norm and post_mlp_norm (give both or neither)");
  TORCH_CHECK(!layer.post_attn_norm || norm_ == NormKind::kRmsNorm, "layer ", l,
              ": post norms are RMSNorms, in a stack of rms_norm blocks");
  push_layer(std::move(layer), dtype, hidden, inter);
}

void DecoderStack::push_layer(Layer layer, at::ScalarType dtype, int64_t hidden, int64_t inter) {
  const int64_t l = num_layers();
  TORCH_CHECK(l == 0 || inter == inter_, "layer ", l, "'s MLP width ", inter,
              " differs from layer 0's ", inter_);
  if (l > 0) {
    const Layer& first = layers_[0];
    const std::pair<const std::optional<at::Tensor>*, const std::optional<at::Tensor>*> same[] = {
        {&layer.attn_norm_bias, &first.attn_norm_bias}, {&layer.qkv.bias, &first.qkv.bias},
        {&layer.out.bias, &first.out.bias}, {&layer.mlp_norm_bias, &first.mlp_norm_bias},
        {&layer.up.bias, &first.up.bias}, {&layer.down.bias, &first.down.bias},
        {&layer.q_norm, &first.q_norm}, {&layer.post_attn_norm, &first.post_attn_norm}};
    for (const auto& [mine, theirs] : same) {
      TORCH_CHECK(mine->has_value() == theirs->has_value(), "layer ", l,
                  " has a different set of optional weights (biases, QK norms, post norms) than "
                  "layer 0 (every layer must have the same)");
    }
  }
  num_rotary_ = std::max(num_rotary_, layer.rotary + 1);
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
             rotary_cos, rotary_sin, 0, 2 * num_layers(), true, false);
}

at::Tensor DecoderStack::forward_lora(
    const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
    const at::Tensor& context_lens, const at::Tensor& block_table,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const at::Tensor& lora_slots) const {
  return run(x, k_caches, v_caches, cu_q_lens, context_lens, block_table, slot_mapping,
             rotary_cos, rotary_sin, 0, 2 * num_layers(), true, false, &lora_slots);
}

void DecoderStack::set_lora(const std::vector<c10::Dict<std::string, at::Tensor>>& layers,
                            const at::Tensor& scales) {
  const int64_t L = num_layers();
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L, "set_lora needs one entry per layer (",
              L, "), got ", layers.size());
  check_dim(scales, "scales", 1, "[slots]");
  check_dtype(scales, "scales", at::kFloat);
  check_contiguous(scales, "scales");
  const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
  const int64_t up_width = is_gated(act_) ? 2 * inter_ : inter_;
  // name, input width, output width
  const std::array<std::tuple<const char*, int64_t, int64_t>, 4> shapes{
      {{"qkv", hidden_, qkv_width}, {"out", num_heads_ * head_dim_, hidden_},
       {"up", hidden_, up_width}, {"down", inter_, hidden_}}};
  std::vector<std::array<LoraPair, 4>> pairs(L);
  for (int64_t l = 0; l < L; ++l) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto& [name, in, out] = shapes[i];
      const std::string a_name = std::string(name) + "_a", b_name = std::string(name) + "_b";
      TORCH_CHECK(layers[l].contains(a_name) && layers[l].contains(b_name), "set_lora: layer ",
                  l, " lacks ", a_name, " or ", b_name);
      const at::Tensor a = layers[l].at(a_name), b = layers[l].at(b_name);
      for (const auto& [t, what, width] : {std::tuple{&a, a_name, in}, {&b, b_name, out}}) {
        TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                        t->size(0) == scales.size(0) && t->size(1) == a.size(1) &&
                        t->size(2) == width,
                    "set_lora: layer ", l, "'s ", what, " must be contiguous float32 [",
                    scales.size(0), ", ", a.size(1), ", ", width, "], got ", t->scalar_type(),
                    " ", shape_str(*t));
      }
      pairs[l][i] = {a, b};
    }
  }
  lora_ = std::move(pairs);
  lora_scales_ = scales;
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
             rotary_cos, rotary_sin, step, step + 1, add_residual, true);
}

at::Tensor DecoderStack::forward_partial_lora(
    const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
    const at::Tensor& context_lens, const at::Tensor& block_table,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, int64_t step, bool add_residual,
    const at::Tensor& lora_slots) const {
  TORCH_CHECK(step >= 0 && step < 2 * num_layers(), "step must be in [0, ", 2 * num_layers(),
              ") (2 per layer: attention, then MLP), got ", step);
  return run(x, k_caches, v_caches, cu_q_lens, context_lens, block_table, slot_mapping,
             rotary_cos, rotary_sin, step, step + 1, add_residual, true, &lora_slots);
}

at::Tensor DecoderStack::run(const at::Tensor& x_in, const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches,
                             const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_table, const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& rotary_cos,
                             const std::optional<at::Tensor>& rotary_sin, int64_t step_begin,
                             int64_t step_end, bool add_residual, bool partial,
                             const at::Tensor* lora_slots) const {
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
                     quant_isa_choice().get(), attention_isa_choice().get()};
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
              "rotary_cos and rotary_sin must be given together");
  int64_t rotary_dim = 0;
  if (rotary_cos) {
    for (const auto& [t, name] : {std::pair{&*rotary_cos, "rotary_cos"}, {&*rotary_sin,
                                                                          "rotary_sin"}}) {
      check_dim(*t, name, 3, "[num_tables, T, rotary_dim / 2]");
      check_same_dtype(*t, name, x_in, "x");
      check_same_device(*t, name, x_in, "x");
      TORCH_CHECK(t->size(0) >= num_rotary_ && t->size(1) == T && t->size(2) > 0 &&
                      2 * t->size(2) <= head_dim_,
                  name, " must be [num_tables >= ", num_rotary_, ", T = ", T,
                  ", rotary_dim / 2 <= head_dim / 2 = ", head_dim_ / 2, "], got ", shape_str(*t));
    }
    TORCH_CHECK(rotary_cos->sizes() == rotary_sin->sizes(), "rotary_cos ",
                shape_str(*rotary_cos), " and rotary_sin ", shape_str(*rotary_sin),
                " must have the same shape");
    rotary_dim = 2 * rotary_cos->size(2);
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
                      cache->scalar_type() == k_caches[0].scalar_type() &&
                      cache->device().is_cpu(),
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
  // Each row's adapter slot, from its request's.
  std::vector<int32_t> row_slot;
  if (lora_slots != nullptr) {
    TORCH_CHECK(!lora_.empty(), "forward_lora needs the adapters' slots (set_lora first)");
    check_dim(*lora_slots, "lora_slots", 1, "[B]");
    check_dtype(*lora_slots, "lora_slots", at::kInt);
    const int64_t B = cu.size(0) - 1, num_slots = lora_scales_.size(0);
    TORCH_CHECK(lora_slots->size(0) == B, "lora_slots has ", lora_slots->size(0),
                " entries but cu_q_lens describes ", B, " requests");
    const at::Tensor req_slot = lora_slots->contiguous();
    row_slot.assign(T, -1);
    for (int64_t r = 0; r < B; ++r) {
      const int32_t slot = req_slot.data_ptr<int32_t>()[r];
      TORCH_CHECK(slot >= -1 && slot < num_slots, "lora_slots[", r, "] = ", slot,
                  " is outside [-1, ", num_slots, ")");
      for (int32_t t = cu.data_ptr<int32_t>()[r]; t < cu.data_ptr<int32_t>()[r + 1]; ++t) {
        row_slot[t] = slot;
      }
    }
  }
  at::Tensor x = x_in.contiguous().clone();
  if (T == 0) return x;
  const std::optional<at::Tensor> cos = contiguous(rotary_cos), sin = contiguous(rotary_sin);
  ORCA_DISPATCH_FLOAT_TYPES(x.scalar_type(), "DecoderStack.forward", [&] {
    const StepArgs<scalar_t> args{k_caches, v_caches, cu.data_ptr<int32_t>(),
                                  ctx.data_ptr<int32_t>(), table.data_ptr<int32_t>(),
                                  slots.data_ptr<int64_t>(),
                                  cos ? cos->data_ptr<scalar_t>() : nullptr,
                                  sin ? sin->data_ptr<scalar_t>() : nullptr, rotary_dim};
    const StepLora lora{row_slot.data(),
                        lora_scales_.defined() ? lora_scales_.data_ptr<float>() : nullptr, lora_,
                        lora_isa_choice().get()};
    fused_stack<scalar_t>(x, s, layers_, args, as, norm_eps_, step_begin, step_end, add_residual,
                          partial, lora_slots != nullptr ? &lora : nullptr);
  });
  return x;
}

}  // namespace orca
