// Input validation shared by the CPU and CUDA launchers. Every failed check raises a Python
// RuntimeError (via TORCH_CHECK) naming the argument and the expected vs given value.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <string>

// float32, bfloat16 and float16: the dtypes every orca op supports.
#define ORCA_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace orca {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D ", layout, ", got shape ", shape_str(t));
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
}

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", dt);
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(),
              " but ", ref_name, " has dtype ", ref.scalar_type(), "; they must match");
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; they must be on the same device");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (shape ", shape_str(t), ", strides ",
              c10::str(t.strides()), ")");
}

// rms_norm's inputs: x [..., K] of a float dtype, weight [K], the residual shaped as x.
inline void check_rms_norm_inputs(const at::Tensor& x, const at::Tensor& weight, double eps,
                                  const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension ([..., K]), got a scalar");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  check_dim(weight, "weight", 1, "[K]");
  check_same_dtype(weight, "weight", x, "x");
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK(weight.size(0) == x.size(-1), "weight has ", weight.size(0),
              " entries but x's last dimension is ", x.size(-1), " (x ", shape_str(x), ")");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  if (residual) {
    check_same_dtype(*residual, "residual", x, "x");
    check_same_device(*residual, "residual", x, "x");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape ", shape_str(x),
                ", got ", shape_str(*residual));
  }
}

// An int8 KV cache (kv_cache_dtype "int8", CPU): [num_blocks, block_size, Hkv, D + 4], each
// (token, KV head) row D int8 values then the row's float32 scale.
constexpr int64_t kInt8KvScaleBytes = 4;

inline bool is_int8_kv_cache(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

// The head dim a KV cache holds (an int8 cache's rows also hold their scale).
inline int64_t kv_cache_head_dim(const at::Tensor& cache) {
  return is_int8_kv_cache(cache) ? cache.size(3) - kInt8KvScaleBytes : cache.size(3);
}

// Whether `cache` is an int8 KV cache, checked to be one that can run (CPU, rows longer than
// their scale).
inline bool check_int8_kv_cache(const at::Tensor& cache, const char* name) {
  if (!is_int8_kv_cache(cache)) return false;
  TORCH_CHECK(cache.device().is_cpu(), name, " is an int8 KV cache, which runs on CPU only; ",
              "got one on ", cache.device());
  TORCH_CHECK(cache.size(3) > kInt8KvScaleBytes, "int8 ", name, " rows must hold head_dim + ",
              kInt8KvScaleBytes, " bytes (values, then a float32 scale), got ", cache.size(3));
  TORCH_CHECK(cache.size(3) - kInt8KvScaleBytes <= 256, "int8 ", name, " rows hold head_dim <= ",
              "256 values, got head_dim ", cache.size(3) - kInt8KvScaleBytes);
  return true;
}

// An fp8 KV cache (kv_cache_dtype "fp8_e4m3", CUDA): [num_blocks, block_size, Hkv, D] of
// float8_e4m3fn values, K and V as they are (no scale), rounded to nearest even and saturated
// at +-448 when stored.
inline bool is_fp8_kv_cache(const at::Tensor& cache) {
  return cache.scalar_type() == at::kFloat8_e4m3fn;
}

// Whether `cache` is an fp8 KV cache, checked to be on CUDA (the only kernels that read one).
inline bool check_fp8_kv_cache(const at::Tensor& cache, const char* name) {
  if (!is_fp8_kv_cache(cache)) return false;
  TORCH_CHECK(cache.is_cuda(), name, " is an fp8_e4m3 KV cache, which runs on CUDA only; got "
              "one on ", cache.device());
  return true;
}

// Whether `cache` holds K/V in a format of its own (int8 or fp8), written from K/V of any float
// dtype, rather than in the activations' dtype.
inline bool check_quantized_kv_cache(const at::Tensor& cache, const char* name) {
  return check_int8_kv_cache(cache, name) || check_fp8_kv_cache(cache, name);
}

// Shapes and dtypes of ragged_attention's inputs; value checks (block ids, monotone offsets)
// need the metadata on the host and are done by the CPU launcher only.
struct AttentionShape {
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size, batch,
      max_blocks;
};

inline AttentionShape check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache,
                                             const at::Tensor& cu_q_lens,
                                             const at::Tensor& context_lens,
                                             const at::Tensor& block_table, double scale,
                                             int64_t window = 0) {
  check_dim(q, "q", 3, "[T, Hq, D]");
  check_dim(k_cache, "k_cache", 4, "[num_blocks, block_size, Hkv, D]");
  check_float_dtype(q, "q");
  if (check_quantized_kv_cache(k_cache, "k_cache")) {
    check_same_dtype(v_cache, "v_cache", k_cache, "k_cache");
  } else {
    check_same_dtype(k_cache, "k_cache", q, "q");
    check_same_dtype(v_cache, "v_cache", q, "q");
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", shape_str(v_cache),
              " must equal k_cache shape ", shape_str(k_cache));
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  check_dim(cu_q_lens, "cu_q_lens", 1, "[B+1]");
  check_dim(context_lens, "context_lens", 1, "[B]");
  check_dim(block_table, "block_table", 2, "[B, max_blocks]");
  check_dtype(cu_q_lens, "cu_q_lens", at::kInt);
  check_dtype(context_lens, "context_lens", at::kInt);
  check_dtype(block_table, "block_table", at::kInt);
  for (const auto& [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&cu_q_lens, "cu_q_lens"}, {&context_lens, "context_lens"},
                                {&block_table, "block_table"}}) {
    check_same_device(*t, name, q, "q");
  }
  AttentionShape s{q.size(0),       q.size(1),       k_cache.size(2),      q.size(2),
                   k_cache.size(0), k_cache.size(1), context_lens.size(0), block_table.size(1)};
  TORCH_CHECK(kv_cache_head_dim(k_cache) == s.head_dim, "k_cache head_dim ",
              kv_cache_head_dim(k_cache), " must equal q head_dim ", s.head_dim,
              is_int8_kv_cache(k_cache) ? " (an int8 cache's rows are head_dim + 4 bytes)" : "");
  TORCH_CHECK(s.num_kv_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, "q has ",
              s.num_q_heads, " heads, which is not a multiple of the cache's ", s.num_kv_heads,
              " KV heads");
  TORCH_CHECK(s.block_size >= 1, "k_cache block_size must be >= 1, got ", s.block_size);
  TORCH_CHECK(cu_q_lens.size(0) == s.batch + 1, "cu_q_lens must have B+1 = ", s.batch + 1,
              " entries (B = context_lens.size(0)), got ", cu_q_lens.size(0));
  TORCH_CHECK(block_table.size(0) == s.batch, "block_table must have B = ", s.batch,
              " rows, got shape ", shape_str(block_table));
  TORCH_CHECK(s.head_dim >= 1 && s.head_dim <= 256, "head_dim must be in [1, 256], got ",
              s.head_dim);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a finite positive number, got ",
              scale);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  return s;
}

inline void check_store_kv_inputs(const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slot_mapping) {
  check_dim(key, "key", 3, "[T, Hkv, D]");
  check_dim(k_cache, "k_cache", 4, "[num_blocks, block_size, Hkv, D]");
  const bool quantized_cache = check_quantized_kv_cache(k_cache, "k_cache");
  if (!quantized_cache) check_float_dtype(k_cache, "k_cache");
  TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", shape_str(value),
              " must equal key shape ", shape_str(key));
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", shape_str(v_cache),
              " must equal k_cache shape ", shape_str(k_cache));
  if (quantized_cache) {  // K/V of any float dtype, converted as they are stored
    check_float_dtype(key, "key");
    check_same_dtype(value, "value", key, "key");
  } else {
    check_same_dtype(key, "key", k_cache, "k_cache");
    check_same_dtype(value, "value", k_cache, "k_cache");
  }
  check_same_dtype(v_cache, "v_cache", k_cache, "k_cache");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == kv_cache_head_dim(k_cache),
              "key is ", shape_str(key), " but the cache holds [Hkv, D] = [", k_cache.size(2),
              ", ", kv_cache_head_dim(k_cache), "]");
  check_dim(slot_mapping, "slot_mapping", 1, "[T]");
  check_dtype(slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
              " entries but key has T = ", key.size(0), " tokens");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  for (const auto& [t, name] : {std::pair{&value, "value"}, {&k_cache, "k_cache"},
                                {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}}) {
    check_same_device(*t, name, key, "key");
  }
}

enum class Activation { kNone, kGeluTanh, kRelu, kSiluAndMul, kGeluTanhAndMul };

// Gated activations: the weight's rows are gate rows then up rows, the output act(gate) * up
// (silu for Llama's MLP, gelu_tanh for Gemma's), half as wide.
constexpr bool is_gated(Activation act) {
  return act == Activation::kSiluAndMul || act == Activation::kGeluTanhAndMul;
}

inline Activation parse_activation(c10::string_view name) {
  if (name == "none") return Activation::kNone;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "relu") return Activation::kRelu;
  if (name == "silu_and_mul") return Activation::kSiluAndMul;
  if (name == "gelu_tanh_and_mul") return Activation::kGeluTanhAndMul;
  TORCH_CHECK(false, "activation must be one of 'none', 'gelu_tanh', 'relu', 'silu_and_mul', "
              "'gelu_tanh_and_mul', got '", std::string(name), "'");
}

// packed_linear's optional norm of its input rows (the norm before the linear in a block).
enum class NormKind { kNone, kLayerNorm, kRmsNorm };

struct InputNorm {
  NormKind kind;
  const std::optional<at::Tensor>& weight;
  const std::optional<at::Tensor>& bias;
  double eps;
};

inline NormKind parse_norm(c10::string_view name) {
  if (name == "none") return NormKind::kNone;
  if (name == "layer_norm") return NormKind::kLayerNorm;
  if (name == "rms_norm") return NormKind::kRmsNorm;
  TORCH_CHECK(false, "norm must be one of 'none', 'layer_norm', 'rms_norm', got '",
              std::string(name), "'");
}

inline void check_input_norm(const at::Tensor& x, const InputNorm& norm) {
  if (norm.kind == NormKind::kNone) {
    TORCH_CHECK(!norm.weight && !norm.bias,
                "norm_weight / norm_bias are given but norm is 'none'");
    return;
  }
  TORCH_CHECK(norm.weight.has_value(), "norm needs norm_weight [K]");
  TORCH_CHECK(norm.kind == NormKind::kLayerNorm || !norm.bias,
              "rms_norm takes no norm_bias");
  TORCH_CHECK(std::isfinite(norm.eps) && norm.eps >= 0, "norm_eps must be finite and >= 0, got ",
              norm.eps);
  for (const auto* t : {&norm.weight, &norm.bias}) {
    if (!t->has_value()) continue;
    const char* name = t == &norm.weight ? "norm_weight" : "norm_bias";
    check_dim(**t, name, 1, "[K]");
    check_same_dtype(**t, name, x, "x");
    check_same_device(**t, name, x, "x");
    TORCH_CHECK((*t)->size(0) == x.size(1), name, " has ", (*t)->size(0),
                " entries but x has K = ", x.size(1), " columns");
  }
}

// x's rows normalized as `norm` says, with ATen ops (the paths above decode sizes, and CUDA).
inline at::Tensor normalize_rows(const at::Tensor& x, const InputNorm& norm) {
  if (norm.kind == NormKind::kLayerNorm) {
    return at::layer_norm(x, {x.size(1)}, norm.weight, norm.bias, norm.eps);
  }
  const at::Tensor h = x.to(at::kFloat);
  return *norm.weight * (h * at::rsqrt(h.square().mean(-1, true) + norm.eps)).to(x.scalar_type());
}

// What a linear with N output rows of `weight_name` checks beyond its weight: a gated
// activation's even row count, the bias [N], the residual (the output's shape) and the input
// norm.
inline InputNorm check_epilogue_inputs(const at::Tensor& x, int64_t N, const char* weight_name,
                                       Activation act, const std::optional<at::Tensor>& bias,
                                       const std::optional<at::Tensor>& residual,
                                       c10::string_view norm,
                                       const std::optional<at::Tensor>& norm_weight,
                                       const std::optional<at::Tensor>& norm_bias,
                                       double norm_eps) {
  if (is_gated(act)) {
    TORCH_CHECK(N % 2 == 0,
                act == Activation::kSiluAndMul ? "silu_and_mul" : "gelu_tanh_and_mul", " needs ",
                weight_name, " with 2I rows (gate rows then up rows), got an odd number of rows: ",
                N);
  }
  if (bias.has_value()) {
    check_dim(*bias, "bias", 1, "[N]");
    check_same_dtype(*bias, "bias", x, "x");
    check_same_device(*bias, "bias", x, "x");
    TORCH_CHECK(bias->size(0) == N, "bias has ", bias->size(0), " entries but ", weight_name,
                " has N = ", N, " rows");
  }
  if (residual.has_value()) {
    const int64_t n_out = is_gated(act) ? N / 2 : N;
    check_same_dtype(*residual, "residual", x, "x");
    check_same_device(*residual, "residual", x, "x");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == x.size(0) &&
                    residual->size(1) == n_out,
                "residual must be the output's shape [", x.size(0), ", ", n_out, "], got shape ",
                shape_str(*residual));
  }
  const InputNorm input_norm{parse_norm(norm), norm_weight, norm_bias, norm_eps};
  check_input_norm(x, input_norm);
  return input_norm;
}

// packed_linear's arguments as both devices' launchers use them (norm refers to the caller's
// optional tensors).
struct LinearArgs {
  Activation act;
  InputNorm norm;
};

inline LinearArgs check_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      c10::string_view activation,
                                      const std::optional<at::Tensor>& residual,
                                      c10::string_view norm,
                                      const std::optional<at::Tensor>& norm_weight,
                                      const std::optional<at::Tensor>& norm_bias,
                                      double norm_eps) {
  const Activation act = parse_activation(activation);
  check_dim(x, "x", 2, "[T, K]");
  check_dim(weight, "weight", 2, "[N, K]");
  check_float_dtype(x, "x");
  check_same_dtype(weight, "weight", x, "x");
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK(weight.size(1) == x.size(1), "weight is ", shape_str(weight), " but x is ",
              shape_str(x), ": weight.size(1) must equal x.size(1) (K)");
  return {act, check_epilogue_inputs(x, weight.size(0), "weight", act, bias, residual, norm,
                                     norm_weight, norm_bias, norm_eps)};
}

// apply_token_bitmask's inputs: logits [B, V] of a float dtype with contiguous rows, bitmask int32
// [M, W] contiguous with W >= ceil(V / 32), and indices int64 [M] (else M == B), on one device.
inline void check_token_bitmask_inputs(const at::Tensor& logits, const at::Tensor& bitmask,
                                       const std::optional<at::Tensor>& indices) {
  check_dim(logits, "logits", 2, "[B, vocab]");
  check_float_dtype(logits, "logits");
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) <= 1,
              "logits must have a contiguous last (vocab) dimension, got strides ",
              c10::str(logits.strides()));
  check_dim(bitmask, "bitmask", 2, "[num_masks, ceil(vocab / 32)]");
  check_dtype(bitmask, "bitmask", at::kInt);
  check_contiguous(bitmask, "bitmask");
  check_same_device(bitmask, "bitmask", logits, "logits");
  TORCH_CHECK(bitmask.size(1) * 32 >= logits.size(1), "bitmask has ", bitmask.size(1),
              " words per row but logits has ", logits.size(1), " tokens: it needs at least ",
              (logits.size(1) + 31) / 32);
  if (indices) {
    check_dim(*indices, "indices", 1, "[num_masks]");
    check_dtype(*indices, "indices", at::kLong);
    check_same_device(*indices, "indices", logits, "logits");
    TORCH_CHECK(indices->size(0) == bitmask.size(0), "indices has ", indices->size(0),
                " rows but bitmask has ", bitmask.size(0), "; they must match");
  } else {
    TORCH_CHECK(bitmask.size(0) == logits.size(0), "bitmask has ", bitmask.size(0),
                " rows but logits has ", logits.size(0),
                "; without indices they must match");
  }
}

}  // namespace orca
