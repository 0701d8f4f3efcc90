// The process's kernel-path choices, each seeded once from its ORCA_*_ISA variable (envs.h).
// Built with the CPU ops' flags: whether the attention's bf16 pair kernels exist is a
// compile-time fact of that build.
#include "isa_choice.h"

#include "envs.h"
#include "orca/cpu/attention.h"
#include "orca/cpu/lora.h"
#include "orca/cpu/quant_linear.h"

namespace orca {
namespace {

cpu::AttentionIsa best_attention_isa() {
  for (const cpu::AttentionIsa isa : {cpu::AttentionIsa::kAmx, cpu::AttentionIsa::kAvx512Bf16}) {
    if (cpu::attention_isa_supported(isa)) return isa;
  }
  return cpu::AttentionIsa::kPortable;
}

template <typename F>
decltype(auto) by_kind(const std::string& kind, const F& f) {
  if (kind == "quant") return f(quant_isa_choice());
  if (kind == "attention") return f(attention_isa_choice());
  TORCH_CHECK(kind == "lora", "kind must be one of 'quant', 'attention', 'lora', got '", kind,
              "'");
  return f(lora_isa_choice());
}

}  // namespace

IsaChoice<cpu::quant::Isa>& quant_isa_choice() {
  static IsaChoice<cpu::quant::Isa> choice("ORCA_QUANT_ISA", envs::quant_isa(),
                                           cpu::quant::kIsaNames, &cpu::quant::isa_supported,
                                           &cpu::quant::best_isa);
  return choice;
}

IsaChoice<cpu::AttentionIsa>& attention_isa_choice() {
  static IsaChoice<cpu::AttentionIsa> choice("ORCA_ATTENTION_ISA", envs::attention_isa(),
                                             cpu::kAttentionIsaNames,
                                             &cpu::attention_isa_supported, &best_attention_isa);
  return choice;
}

IsaChoice<cpu::lora::Isa>& lora_isa_choice() {
  static IsaChoice<cpu::lora::Isa> choice("ORCA_LORA_ISA", envs::lora_isa(),
                                          cpu::lora::kIsaNames, &cpu::lora::isa_supported,
                                          &cpu::lora::best_isa);
  return choice;
}

void set_isa(const std::string& kind, const std::string& name) {
  by_kind(kind, [&](auto& choice) { choice.set(name, kind + " ISA"); });
}

std::string get_isa(const std::string& kind) {
  return by_kind(kind, [](auto& choice) { return std::string(choice.name(choice.get())); });
}

std::vector<std::string> isa_names(const std::string& kind) {
  return by_kind(kind, [](auto& choice) { return choice.supported_names(); });
}

}  // namespace orca
