// Host (CPU) emulation of the CUDA features the orca kernel headers use, so their device code
// can be executed and checked on a machine without a GPU. Test-only: included by
// csrc/include/orca/cuda/common.cuh when ORCA_CUDA_EMULATE is defined.
//
// Each CUDA thread of a block is an OS thread; blocks run one after another. __syncthreads is a
// block barrier; warp collectives (shuffles, ldmatrix, mma.sync) exchange operands through a
// per-warp buffer between two warp barriers and compute exactly what the PTX ISA specifies
// for them (fragment layouts of ldmatrix / ldmatrix.trans / mma.m16n8k16). cp.async copies are
// deferred until the matching cp.async.wait_group, so a kernel that reads shared memory before
// waiting sees stale data. Shared memory starts filled with 0xFF bytes (NaN for floats).
// Misaligned cp.async / ldmatrix addresses, which fault on a GPU, abort with a message.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

// ---- keywords ----------------------------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace orca_emu {

// What the hardware would reject with a misaligned-address fault: report and stop.
inline void require_aligned16(const void* ptr, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    std::fprintf(stderr, "emulated CUDA fault: %s address %p is not 16-byte aligned\n", what, ptr);
    std::abort();
  }
}

struct WarpShared {
  std::barrier<> bar{32};
  uint64_t word[32][8];
  const void* ptr[32];
};

struct BlockState {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<WarpShared>> warps;
  std::vector<unsigned char> smem;
};

struct Copy {
  void* dst;
  const void* src;
  bool valid;
};

struct ThreadState {
  uint3 thread_idx{}, block_idx{};
  dim3 block_dim{}, grid_dim{};
  BlockState* block = nullptr;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open_group;
};
inline thread_local ThreadState tls;

inline WarpShared& warp() { return *tls.block->warps[(tls.thread_idx.x) / 32]; }
inline int lane_id() { return static_cast<int>(tls.thread_idx.x % 32); }

// Runs body() as a kernel over grid x block threads (1-D blocks; 2-D grids).
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  const unsigned nthreads = block.x * block.y * block.z;
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      BlockState bs;
      bs.bar = std::make_unique<std::barrier<>>(nthreads);
      for (unsigned w = 0; w < (nthreads + 31) / 32; ++w) bs.warps.push_back(std::make_unique<WarpShared>());
      bs.smem.assign(smem_bytes + 16, 0xFF);
      std::vector<std::thread> threads;
      threads.reserve(nthreads);
      for (unsigned t = 0; t < nthreads; ++t) {
        threads.emplace_back([&, t, bx, by] {
          tls = ThreadState{};
          tls.thread_idx = make_uint3(t, 0, 0);
          tls.block_idx = make_uint3(bx, by, 0);
          tls.block_dim = block;
          tls.grid_dim = grid;
          tls.block = &bs;
          body();
        });
      }
      for (auto& th : threads) th.join();
    }
  }
}

inline unsigned char* dynamic_smem() {
  auto p = reinterpret_cast<uintptr_t>(tls.block->smem.data());
  return reinterpret_cast<unsigned char*>((p + 15) / 16 * 16);
}

// Exchange one 64-bit word per lane; returns the words of all lanes via `out`.
template <typename F>
inline void exchange(uint64_t mine, F&& use) {
  WarpShared& w = warp();
  w.word[lane_id()][0] = mine;
  w.bar.arrive_and_wait();
  use(w);
  w.bar.arrive_and_wait();
}

template <typename T>
inline uint64_t to_word(T v) {
  static_assert(sizeof(T) <= 8);
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T from_word(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

inline uint16_t half_of(uint32_t reg, int hi) { return static_cast<uint16_t>(hi ? reg >> 16 : reg); }

template <typename T>
inline float elem_to_float(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return __bfloat162float(v);
}

}  // namespace orca_emu

// ---- built-in variables and functions -------------------------------------------------------
#define threadIdx (orca_emu::tls.thread_idx)
#define blockIdx (orca_emu::tls.block_idx)
#define blockDim (orca_emu::tls.block_dim)
#define gridDim (orca_emu::tls.grid_dim)
#define ORCA_DYNAMIC_SMEM(name) unsigned char* name = orca_emu::dynamic_smem()

inline void __syncthreads() { orca_emu::tls.block->bar->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  T r{};
  orca_emu::exchange(orca_emu::to_word(v), [&](orca_emu::WarpShared& w) {
    r = orca_emu::from_word<T>(w.word[orca_emu::lane_id() ^ mask][0]);
  });
  return r;
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
  T r{};
  orca_emu::exchange(orca_emu::to_word(v), [&](orca_emu::WarpShared& w) {
    const int src = orca_emu::lane_id() - static_cast<int>(delta);
    r = orca_emu::from_word<T>(w.word[src >= 0 ? src : orca_emu::lane_id()][0]);
  });
  return r;
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src_lane) {
  T r{};
  orca_emu::exchange(orca_emu::to_word(v), [&](orca_emu::WarpShared& w) {
    r = orca_emu::from_word<T>(w.word[src_lane & 31][0]);
  });
  return r;
}

template <typename T>
inline T __ldg(const T* p) { return *p; }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float __log2f(float x) { return std::log2(x); }
inline float __expf(float x) { return std::exp(x); }
// exp2f, fmaf, fmaxf, tanhf: the C library's (from <cmath>).
template <typename A, typename B>
inline auto min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B>
inline auto max(A a, B b) { return a < b ? b : a; }

// ---- the hardware helpers of common.cuh --------------------------------------------------------
namespace orca::cuda {

inline float fast_exp2(float x) { return std::exp2(x); }

inline void cp_async16(void* smem, const void* gmem, bool valid) {
  orca_emu::require_aligned16(smem, "cp.async shared");
  orca_emu::require_aligned16(gmem, "cp.async global");
  orca_emu::tls.open_group.push_back({smem, gmem, valid});
}
inline void cp_async_commit() {
  orca_emu::tls.groups.push_back(std::move(orca_emu::tls.open_group));
  orca_emu::tls.open_group.clear();
}
template <int N>
inline void cp_async_wait() {
  auto& g = orca_emu::tls.groups;
  while (g.size() > static_cast<size_t>(N)) {
    for (const auto& c : g.front()) {
      if (c.valid) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    }
    g.erase(g.begin());
  }
}

// ldmatrix .x4: lane l gives the row address of row l % 8 of matrix l / 8; without .trans
// lane t receives elements (t / 4, 2 (t % 4) + {0, 1}) of each matrix, with .trans elements
// (2 (t % 4) + {0, 1}, t / 4).
inline void ldmatrix_impl(uint32_t (&r)[4], const void* smem, bool trans) {
  orca_emu::WarpShared& w = orca_emu::warp();
  const int t = orca_emu::lane_id();
  orca_emu::require_aligned16(smem, trans ? "ldmatrix.trans row" : "ldmatrix row");
  w.ptr[t] = smem;
  w.bar.arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    uint16_t e[2];
    for (int i = 0; i < 2; ++i) {
      const int row = trans ? 2 * (t % 4) + i : t / 4;
      const int col = trans ? t / 4 : 2 * (t % 4) + i;
      std::memcpy(&e[i], static_cast<const unsigned char*>(w.ptr[8 * j + row]) + 2 * col, 2);
    }
    r[j] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
  }
  w.bar.arrive_and_wait();
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) { ldmatrix_impl(r, smem, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) { ldmatrix_impl(r, smem, true); }

// mma.sync.m16n8k16.row.col.f32: groupID = lane / 4, tig = lane % 4.
//  A reg j = {a_2j, a_2j+1}: rows gid (+8 for regs 1, 3), cols 2 tig + {0,1} (+8 for regs 2, 3)
//  B reg j = {b_2j, b_2j+1}: k = 2 tig + {0,1} (+8 for reg 1), n = gid
//  C/D c_i: row gid (+8 for i >= 2), col 2 tig + (i & 1)
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  orca_emu::WarpShared& w = orca_emu::warp();
  const int lane = orca_emu::lane_id();
  for (int j = 0; j < 4; ++j) w.word[lane][j] = a[j];
  w.word[lane][4] = b0;
  w.word[lane][5] = b1;
  w.bar.arrive_and_wait();
  auto A = [&](int row, int k) {
    const int src = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return orca_emu::elem_to_float<T>(
        orca_emu::half_of(static_cast<uint32_t>(w.word[src][reg]), k % 2));
  };
  auto B = [&](int k, int n) {
    const int src = n * 4 + (k % 8) / 2;
    const int reg = 4 + (k >= 8 ? 1 : 0);
    return orca_emu::elem_to_float<T>(
        orca_emu::half_of(static_cast<uint32_t>(w.word[src][reg]), k % 2));
  };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + (i >= 2 ? 8 : 0), col = 2 * (lane % 4) + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  w.bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

}  // namespace orca::cuda
