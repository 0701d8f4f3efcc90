// Torch-free: a runtime token count (1 to 8) turned into a compile-time one, for the kernels
// specialized per token count (the skinny linear, the quantized dot products).
#pragma once

#include <cstdint>

namespace orca::cpu {

// f.template operator()<kT>() for T tokens; T above 8 runs as 8 (callers split larger counts).
template <typename F>
void dispatch_tokens(int64_t T, const F& f) {
  switch (T) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    case 7: return f.template operator()<7>();
    default: return f.template operator()<8>();
  }
}

}  // namespace orca::cpu
