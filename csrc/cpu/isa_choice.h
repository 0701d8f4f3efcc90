// The kernel path an op family runs, one per process: seeded from its environment variable
// (envs.h, read once), changed with orca_ext._C.set_isa (an engine's or a test's choice). Ops
// read it with one atomic load.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace orca {

template <typename Isa>
class IsaChoice {
 public:
  using Names = std::span<const std::pair<const char*, Isa>>;

  // env_var / env_value: the variable that seeds the choice and its value (empty: best()).
  IsaChoice(const char* env_var, const std::string& env_value, Names names,
            bool (*supported)(Isa), Isa (*best)())
      : env_var_(env_var), env_value_(env_value), names_(names), supported_(supported),
        best_(best) {}

  // The path ops run now; a bad environment value raises here (naming the variable) until
  // set() replaces it.
  Isa get() {
    const int chosen = chosen_.load(std::memory_order_relaxed);
    if (chosen >= 0) return static_cast<Isa>(chosen);
    const Isa isa = env_value_.empty() ? best_() : parse(env_value_, env_var_);
    chosen_.store(static_cast<int>(isa), std::memory_order_relaxed);
    return isa;
  }

  // Runs the path `name` from now on (checked: a known name this CPU runs); an empty name goes
  // back to the environment's choice.
  void set(const std::string& name, const std::string& what) {
    chosen_.store(name.empty() ? -1 : static_cast<int>(parse(name, what)),
                  std::memory_order_relaxed);
  }

  const char* name(Isa isa) const {
    for (const auto& [known, value] : names_) {
      if (value == isa) return known;
    }
    return "?";
  }

  // The names of the paths this CPU (and build) runs, slowest first.
  std::vector<std::string> supported_names() const {
    std::vector<std::string> out;
    for (const auto& [known, isa] : names_) {
      if (supported_(isa)) out.emplace_back(known);
    }
    return out;
  }

 private:
  Isa parse(const std::string& name, const std::string& what) const {
    std::string known_names;
    for (const auto& [known, isa] : names_) {
      if (name == known) {
        TORCH_CHECK(supported_(isa), what, " '", name,
                    "' is a path this build or CPU does not run");
        return isa;
      }
      known_names += std::string(known_names.empty() ? "'" : ", '") + known + "'";
    }
    TORCH_CHECK(false, what, " must be one of ", known_names, ", got '", name, "'");
  }

  const char* env_var_;
  std::string env_value_;
  Names names_;
  bool (*supported_)(Isa);
  Isa (*best_)();
  std::atomic<int> chosen_{-1};
};

// The process's choices (isa_choice.cpp): quantized_linear's, ragged_attention's bfloat16
// prefill-like kernels', lora_linear's; the DecoderStack runs the same.
namespace cpu {
namespace quant { enum class Isa; }
namespace lora { enum class Isa; }
enum class AttentionIsa;
}  // namespace cpu
IsaChoice<cpu::quant::Isa>& quant_isa_choice();
IsaChoice<cpu::AttentionIsa>& attention_isa_choice();
IsaChoice<cpu::lora::Isa>& lora_isa_choice();

// The same by kind ('quant', 'attention', 'lora'), for orca_ext._C.
void set_isa(const std::string& kind, const std::string& name);
std::string get_isa(const std::string& kind);
std::vector<std::string> isa_names(const std::string& kind);

}  // namespace orca
