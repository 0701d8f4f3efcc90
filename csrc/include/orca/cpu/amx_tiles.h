// Torch-free AMX basics shared by the attention's and the quantized linear's tile kernels: the
// OS's grant of tile data to the process, and loading a tile configuration. Plain inline asm and
// a system call, so they compile with or without the AMX target.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace orca::cpu::amx {

// Whether the OS lets this process use AMX tile data: Linux grants it on request (arch_prctl
// ARCH_REQ_XCOMP_PERM), per process, asked once; a refusal leaves the other paths.
inline bool tile_data_granted() {
#if defined(__linux__)
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// A palette-1 tile configuration: each tile's bytes per row (colsb) and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg on the whole struct as a memory operand: GCC 12's _tile_loadconfig names only its
// first 8 bytes, so the stores of colsb and rows could be dropped as dead.
inline void load_tile_config(const TileConfig& config) {
  asm volatile("ldtilecfg %0" ::"m"(config));
}

}  // namespace orca::cpu::amx
