// torch.classes.orca.DecoderStack: a model's pre-norm decoder blocks (GPT-2 and Llama shaped),
// prepared once on the CPU and run as one call per decode step. add_layer checks each layer's
// weights and keeps them contiguous; forward checks only what changes per step (the hidden
// states, the caches and the metadata) and runs the whole stack in one parallel region.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "orca/cpu/quant_formats.h"

namespace orca {

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One block's tensors, contiguous; the biases and the norms' biases optional. A linear with
  // a format holds its weight as GGUF blocks (uint8 [N, K / 32 * block_bytes]).
  struct Layer {
    at::Tensor attn_norm, qkv, out, mlp_norm, up, down;
    std::optional<at::Tensor> attn_norm_bias, qkv_bias, out_bias, mlp_norm_bias, up_bias,
        down_bias;
    double scale;
    std::optional<cpu::quant::Format> qkv_format, out_format, up_format, down_format;
  };

  DecoderStack(std::string norm, double norm_eps, std::string activation, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim);

  // Appends a block: x = out(attention(qkv(norm(x)))) + x; x = down(act(up(norm(x)))) + x.
  void add_layer(const at::Tensor& attn_norm_weight,
                 const std::optional<at::Tensor>& attn_norm_bias, const at::Tensor& qkv_weight,
                 const std::optional<at::Tensor>& qkv_bias, const at::Tensor& out_weight,
                 const std::optional<at::Tensor>& out_bias, const at::Tensor& mlp_norm_weight,
                 const std::optional<at::Tensor>& mlp_norm_bias, const at::Tensor& up_weight,
                 const std::optional<at::Tensor>& up_bias, const at::Tensor& down_weight,
                 const std::optional<at::Tensor>& down_bias, double scale);

  // add_layer with each linear's weight as GGUF blocks of its format ('q8_0', 'q4_0', 'q4_1'),
  // as quantized_linear takes them; the norms, biases and hidden states stay float.
  void add_quantized_layer(
      const at::Tensor& attn_norm_weight, const std::optional<at::Tensor>& attn_norm_bias,
      const at::Tensor& qkv_weight, const std::string& qkv_format,
      const std::optional<at::Tensor>& qkv_bias, const at::Tensor& out_weight,
      const std::string& out_format, const std::optional<at::Tensor>& out_bias,
      const at::Tensor& mlp_norm_weight, const std::optional<at::Tensor>& mlp_norm_bias,
      const at::Tensor& up_weight, const std::string& up_format,
      const std::optional<at::Tensor>& up_bias, const at::Tensor& down_weight,
      const std::string& down_format, const std::optional<at::Tensor>& down_bias, double scale);

  // The stack on packed hidden states x [T, hidden] (T <= max_tokens()); stores each layer's
  // new K/V in k_caches[l] / v_caches[l] and returns the new hidden states.
  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                     const at::Tensor& context_lens, const at::Tensor& block_table,
                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
                     const std::optional<at::Tensor>& rotary_sin) const;

  // One half of one layer for a tensor-parallel rank (step 2l: layer l's attention, 2l + 1:
  // its MLP): returns x's new value without the all-reduce, so the residual is added by one
  // rank only (add_residual); the caller sums the ranks' results before the next step.
  at::Tensor forward_partial(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                             const at::Tensor& context_lens, const at::Tensor& block_table,
                             const at::Tensor& slot_mapping,
                             const std::optional<at::Tensor>& rotary_cos,
                             const std::optional<at::Tensor>& rotary_sin, int64_t step,
                             bool add_residual) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // The most tokens a call should take (8; 64 for quantized layers on amx_int8).
  int64_t max_tokens() const;

 private:
  at::Tensor run(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const at::Tensor& cu_q_lens,
                 const at::Tensor& context_lens, const at::Tensor& block_table,
                 const at::Tensor& slot_mapping, const std::optional<at::Tensor>& rotary_cos,
                 const std::optional<at::Tensor>& rotary_sin, int64_t step_begin,
                 int64_t step_end, bool add_residual) const;

  // Checks that layer l (hidden wide, of dtype) agrees with layer 0, then appends it.
  void push_layer(Layer layer, at::ScalarType dtype, int64_t hidden, int64_t inter);

  NormKind norm_;
  double norm_eps_;
  Activation act_;
  std::string activation_name_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  int64_t hidden_ = 0, inter_ = 0;
  at::ScalarType dtype_ = at::kFloat;  // the hidden states' (every layer's norms and biases)
  std::vector<Layer> layers_;
};

}  // namespace orca
