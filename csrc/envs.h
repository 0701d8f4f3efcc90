// The runtime knobs the C++ reads, each read from the environment once (at first use) and kept
// for the process; orca_ext/envs.py lists the Python's. Only kernel-path overrides live here:
// they seed each op family's choice (cpu/isa_choice.h), which orca_ext._C.set_isa changes.
#pragma once

#include <cstdlib>
#include <string>

namespace orca::envs {

inline std::string read_once(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

// ORCA_QUANT_ISA: quantized_linear's and the DecoderStack's quantized kernels' path
// (portable, avx2, avx512, avx512_vnni, amx_int8); unset or empty: the best this CPU runs.
inline const std::string& quant_isa() {
  static const std::string value = read_once("ORCA_QUANT_ISA");
  return value;
}

// ORCA_ATTENTION_ISA: ragged_attention's bfloat16 prefill-like kernels (portable, avx512bf16,
// amx); unset or empty: the best this build and CPU run.
inline const std::string& attention_isa() {
  static const std::string value = read_once("ORCA_ATTENTION_ISA");
  return value;
}

// ORCA_LORA_ISA: lora_linear's and the DecoderStack's LoRA kernels (portable, avx2, avx512);
// unset or empty: the best this CPU runs.
inline const std::string& lora_isa() {
  static const std::string value = read_once("ORCA_LORA_ISA");
  return value;
}

}  // namespace orca::envs
