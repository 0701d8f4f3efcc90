// torch.classes.orca.DecoderStack: a model's decoder blocks, prepared once on the CPU and run as
// one call per decode step. The block is the one orca_ext/model/decoder.py describes: a norm
// before attention and MLP, optional QK norms on each head, optional norms on the attention and
// MLP outputs before their residual adds (Gemma), rotary tables and an attention window chosen
// per layer. add_layer checks each layer's weights and keeps them contiguous; forward checks only
// what changes per step and runs the whole stack in one parallel region.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <torch/custom_class.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "quant_blocks.h"

namespace orca {

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One linear: a float weight [N, K] or GGUF blocks of `format` (uint8 [N, row_bytes], in
  // the row or the x16 layout).
  struct Linear {
    at::Tensor weight;
    std::optional<at::Tensor> bias;
    std::optional<QuantLayout> format;
  };

  // One block's tensors, contiguous.
  struct Layer {
    at::Tensor attn_norm, mlp_norm;
    std::optional<at::Tensor> attn_norm_bias, mlp_norm_bias;
    std::optional<at::Tensor> q_norm, k_norm;  // RMSNorm of each q / k head [head_dim]
    std::optional<at::Tensor> post_attn_norm, post_mlp_norm;  // RMSNorm before the adds
    Linear qkv, out, up, down;
    double scale;     // the attention's softmax scale
    int64_t window;   // the attention window (0: full causal attention)
    int64_t rotary;   // which of forward's rotary tables rotates q and k
  };

  DecoderStack(std::string norm, double norm_eps, std::string activation, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim);

  // Appends a block: x += post_attn_norm(out(attention(qkv(norm(x))))), then
  // x += post_mlp_norm(down(act(up(norm(x))))), the post norms where given. `weights` maps
  // names to tensors: attn_norm, qkv, out, mlp_norm, up, down (required); attn_norm_bias,
  // qkv_bias, out_bias, mlp_norm_bias, up_bias, down_bias, q_norm, k_norm, post_attn_norm,
  // post_mlp_norm (optional, but the same set in every layer). `formats` names the block format
  // (any quantized_linear reads: 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_m', 'q4_K',
  // 'q5_K', 'q6_K') of each of qkv, out, up, down that holds blocks; the others are float
  // weights of the hidden states' dtype.
  void add_layer(const c10::Dict<std::string, at::Tensor>& weights,
                 const c10::Dict<std::string, std::string>& formats, double scale,
                 int64_t window, int64_t rotary);

  // The stack on packed hidden states x [T, hidden] (T <= max_tokens()); stores each layer's
  // new K/V in k_caches[l] / v_caches[l] and returns the new hidden states. rotary_cos / sin
  // are [R, T, rotary_dim / 2] (a layer uses table `rotary`), or None for no rotary.
  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                     const at::Tensor& context_lens, const at::Tensor& block_table,
                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
                     const std::optional<at::Tensor>& rotary_sin) const;

  // One half of one layer for a tensor-parallel rank (step 2l: layer l's attention, 2l + 1:
  // its MLP), up to its row-parallel linear's partial sum, which the caller all-reduces: with
  // the residual added when add_residual (one rank only); for a block with post norms, the raw
  // sum (the caller applies the post norm and the residual add after the all-reduce).
  at::Tensor forward_partial(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                             const at::Tensor& context_lens, const at::Tensor& block_table,
                             const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& rotary_cos,
                             const std::optional<at::Tensor>& rotary_sin, int64_t step,
                             bool add_residual) const;

  // LoRA adapter slots, held by reference (the runner refills slots in place): per layer, the
  // float32 a [slots, R, in] and b [slots, R, out] (B transposed, as lora_linear takes them) of
  // qkv, out, up and down (names qkv_a, qkv_b, out_a, ...), and the slots' scales [slots].
  void set_lora(const std::vector<c10::Dict<std::string, at::Tensor>>& layers,
                const at::Tensor& scales);

  // forward with each request's adapter slot, lora_slots int32 [B] (-1: none): request r's rows
  // cu_q_lens[r]..cu_q_lens[r + 1] get their slot's delta after each linear (the up linear's
  // before its activation), as the per-op layers add ops.lora_linear's.
  at::Tensor forward_lora(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                          const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                          const at::Tensor& context_lens, const at::Tensor& block_table,
                          const at::Tensor& slot_mapping,
                          const std::optional<at::Tensor>& rotary_cos,
                          const std::optional<at::Tensor>& rotary_sin,
                          const at::Tensor& lora_slots) const;

  // forward_partial with each request's adapter slot, as forward_lora: a tensor-parallel rank's
  // share of each delta (its slice of A for the row-parallel linears) goes into its partial sums.
  at::Tensor forward_partial_lora(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches,
                                  const at::Tensor& cu_q_lens, const at::Tensor& context_lens,
                                  const at::Tensor& block_table, const at::Tensor& slot_mapping,
                                  const std::optional<at::Tensor>& rotary_cos,
                                  const std::optional<at::Tensor>& rotary_sin, int64_t step,
                                  bool add_residual, const at::Tensor& lora_slots) const;

  // One linear's LoRA slots.
  struct LoraPair {
    at::Tensor a, b;
  };

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // The most tokens a call should take (8; 64 where every linear holds blocks, on amx_int8).
  int64_t max_tokens() const;

 private:
  at::Tensor run(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                 const at::Tensor& context_lens, const at::Tensor& block_table,
                 const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
                 const std::optional<at::Tensor>& rotary_sin, int64_t step_begin,
                 int64_t step_end, bool add_residual, bool partial,
                 const at::Tensor* lora_slots = nullptr) const;

  // Checks that the layer agrees with layer 0 (its optional tensors, widths), then appends it.
  void push_layer(Layer layer, at::ScalarType dtype, int64_t hidden, int64_t inter);

  NormKind norm_;
  double norm_eps_;
  Activation act_;
  std::string activation_name_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  int64_t hidden_ = 0, inter_ = 0, num_rotary_ = 0;  // num_rotary_: 1 + the largest table used
  at::ScalarType dtype_ = at::kFloat;  // the hidden states' (every layer's norms and biases)
  std::vector<Layer> layers_;
  std::vector<std::array<LoraPair, 4>> lora_;  // per layer: qkv, out, up, down (empty: no LoRA)
  at::Tensor lora_scales_;
};

}  // namespace orca
