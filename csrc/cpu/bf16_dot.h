// Whether a CPU launcher's bfloat16 data goes through the AVX512-BF16 pair dot products
// (vdpbf16ps): where the build targets a CPU that has them (-march=native on one that does).
#pragma once

#include <c10/util/BFloat16.h>

#include <type_traits>

namespace orca {

template <typename scalar_t>
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<scalar_t, c10::BFloat16>;
#else
    false;
#endif

}  // namespace orca
