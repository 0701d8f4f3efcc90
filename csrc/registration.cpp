// The one TORCH_LIBRARY of orca_ext: every op schema. Kernels register per device in
// csrc/cpu/*.cpp and csrc/cuda/*.cpp; fake (meta) kernels are in orca_ext/ops.py.
#include <torch/library.h>

#include "cpu/decoder_stack.h"

TORCH_LIBRARY(orca, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, str activation=\"none\", "
        "Tensor? residual=None, str norm=\"none\", Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float norm_eps=1e-05) -> Tensor");
  m.def("logits_linear(Tensor x, Tensor weight, str norm=\"none\", Tensor? norm_weight=None, "
        "Tensor? norm_bias=None, float norm_eps=1e-05) -> Tensor");
  m.def("quantized_linear(Tensor x, Tensor qweight, str format, int in_features, Tensor? bias, "
        "str activation=\"none\", Tensor? residual=None, str norm=\"none\", "
        "Tensor? norm_weight=None, Tensor? norm_bias=None, float norm_eps=1e-05, "
        "bool int8_activations=True) -> Tensor");
  m.def("quantized_embedding(Tensor ids, Tensor qweight, str format, int embedding_dim) -> "
        "Tensor");
  // A quantized weight's rows to and from the x16 layout (orca/cpu/quant_rows16.h).
  m.def("interleave_rows16(Tensor qweight, str format, int in_features) -> Tensor");
  m.def("deinterleave_rows16(Tensor qweight, str format, int in_features) -> Tensor");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  // One step's checked metadata and attention work items (CPU), for every layer's
  // ragged_attention of that window: FlashInfer's plan / run.
  m.def("plan_attention(Tensor q, Tensor k_cache, Tensor cu_q_lens, Tensor context_lens, "
        "Tensor block_table, int window=0) -> Tensor");
  m.def("ragged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_q_lens, "
        "Tensor context_lens, Tensor block_table, float scale, int window=0, "
        "Tensor? plan=None) -> Tensor");
  m.def("lora_linear(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scales, "
        "Tensor cu_seg_lens, Tensor seg_slots) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? indices=None) -> ()");
  // A model's decoder blocks prepared once for decode steps on the CPU (cpu/decoder_stack.h).
  m.class_<orca::DecoderStack>("DecoderStack")
      .def(torch::init<std::string, double, std::string, int64_t, int64_t, int64_t>(), "",
           {torch::arg("norm"), torch::arg("norm_eps"), torch::arg("activation"),
            torch::arg("num_heads"), torch::arg("num_kv_heads"), torch::arg("head_dim")})
      .def("add_layer", &orca::DecoderStack::add_layer, "",
           {torch::arg("weights"), torch::arg("formats"), torch::arg("scale"),
            torch::arg("window"), torch::arg("rotary")})
      .def("forward", &orca::DecoderStack::forward, "",
           {torch::arg("x"), torch::arg("k_caches"), torch::arg("v_caches"),
            torch::arg("cu_q_lens"), torch::arg("context_lens"), torch::arg("block_table"),
            torch::arg("slot_mapping"), torch::arg("rotary_cos"), torch::arg("rotary_sin")})
      .def("forward_partial", &orca::DecoderStack::forward_partial, "",
           {torch::arg("x"), torch::arg("k_caches"), torch::arg("v_caches"),
            torch::arg("cu_q_lens"), torch::arg("context_lens"), torch::arg("block_table"),
            torch::arg("slot_mapping"), torch::arg("rotary_cos"), torch::arg("rotary_sin"),
            torch::arg("step"), torch::arg("add_residual")})
      .def("set_lora", &orca::DecoderStack::set_lora, "",
           {torch::arg("layers"), torch::arg("scales")})
      .def("forward_lora", &orca::DecoderStack::forward_lora, "",
           {torch::arg("x"), torch::arg("k_caches"), torch::arg("v_caches"),
            torch::arg("cu_q_lens"), torch::arg("context_lens"), torch::arg("block_table"),
            torch::arg("slot_mapping"), torch::arg("rotary_cos"), torch::arg("rotary_sin"),
            torch::arg("lora_slots")})
      .def("forward_partial_lora", &orca::DecoderStack::forward_partial_lora, "",
           {torch::arg("x"), torch::arg("k_caches"), torch::arg("v_caches"),
            torch::arg("cu_q_lens"), torch::arg("context_lens"), torch::arg("block_table"),
            torch::arg("slot_mapping"), torch::arg("rotary_cos"), torch::arg("rotary_sin"),
            torch::arg("step"), torch::arg("add_residual"), torch::arg("lora_slots")})
      .def("num_layers", &orca::DecoderStack::num_layers)
      .def("max_tokens", &orca::DecoderStack::max_tokens);
}
