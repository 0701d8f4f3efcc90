// Integer ceiling division, shared by the CPU launchers.
#pragma once

#include <cstdint>

namespace orca {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace orca
