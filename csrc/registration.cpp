// The one TORCH_LIBRARY of orca_ext: every op schema. Kernels register per device in
// csrc/cpu/*.cpp and csrc/cuda/*.cpp; fake (meta) kernels are in orca_ext/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(orca, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, str activation=\"none\", "
        "Tensor? residual=None, str norm=\"none\", Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float norm_eps=1e-05) -> Tensor");
  m.def("logits_linear(Tensor x, Tensor weight, str norm=\"none\", Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float norm_eps=1e-05) -> Tensor");
  m.def("quantized_linear(Tensor x, Tensor qweight, str format, int in_features, Tensor? bias, "
        "str activation=\"none\", Tensor? residual=None, str norm=\"none\", "
        "Tensor? norm_weight=None, Tensor? norm_bias=None, float norm_eps=1e-05) -> Tensor");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("ragged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_q_lens, "
        "Tensor context_lens, Tensor block_table, float scale) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor[] norm_weights, Tensor[] norm_biases, "
        "Tensor[] weights, Tensor[] qkv_biases, Tensor[] out_biases, Tensor[] up_biases, "
        "Tensor[] down_biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor cu_q_lens, Tensor context_lens, Tensor block_table, Tensor slot_mapping, "
        "Tensor? rotary_cos, Tensor? rotary_sin, str norm, float norm_eps, str activation, "
        "int num_heads, int num_kv_heads, float[] scales) -> Tensor");
}
