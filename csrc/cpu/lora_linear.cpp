// lora_linear on CPU: each run of rows sharing an adapter slot gets that slot's low-rank delta.
// Short runs (decode steps) go through orca/cpu/lora.h's row kernel, rows split across the
// intra-op threads; a run of kGemmRows rows or more (a prompt) is two float32 GEMMs (ATen's),
// which read the slot's A and B once for all its rows. x and y of bfloat16 / float16 are widened
// to float32 for the sums, rounded once into y.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "isa_choice.h"
#include "lora_checks.h"
#include "orca/cpu/lora.h"

namespace orca {
namespace {

using cpu::lora::Isa;

constexpr int64_t kGemmRows = 16;
constexpr int64_t kGroupRows = 8;

// A run of rows [begin, end) of one adapter slot.
struct Run {
  int64_t begin, end;
  int32_t slot;
};

// The segments (checked here) with an adapter: the row of each token of a short one and its
// slot, and the long ones whole.
std::vector<std::pair<int64_t, int32_t>> adapter_rows(const at::Tensor& cu_seg_lens,
                                                      const at::Tensor& seg_slots, int64_t T,
                                                      int64_t num_slots,
                                                      std::vector<Run>& long_runs) {
  const int32_t* cu = cu_seg_lens.data_ptr<int32_t>();
  const int32_t* slots = seg_slots.data_ptr<int32_t>();
  const int64_t S = seg_slots.size(0);
  TORCH_CHECK(cu[0] == 0, "cu_seg_lens[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[S] == T, "cu_seg_lens[-1] must equal the ", T, " rows of x, got ", cu[S]);
  std::vector<std::pair<int64_t, int32_t>> rows;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "cu_seg_lens must not decrease, got ", cu[s], " then ",
                cu[s + 1], " at index ", s);
    TORCH_CHECK(slots[s] >= -1 && slots[s] < num_slots, "seg_slots[", s, "] = ", slots[s],
                " is outside [-1, ", num_slots, ")");
    if (slots[s] < 0) continue;
    if (cu[s + 1] - cu[s] >= kGemmRows) {
      long_runs.push_back({cu[s], cu[s + 1], slots[s]});
      continue;
    }
    for (int64_t r = cu[s]; r < cu[s + 1]; ++r) rows.emplace_back(r, slots[s]);
  }
  return rows;
}

void lora_linear_cpu(at::Tensor& y, const at::Tensor& x_in, const at::Tensor& lora_a_in,
                     const at::Tensor& lora_b_in, const at::Tensor& scales_in,
                     const at::Tensor& cu_seg_lens_in, const at::Tensor& seg_slots_in) {
  check_lora_linear_inputs(y, x_in, lora_a_in, lora_b_in, scales_in, cu_seg_lens_in,
                           seg_slots_in);
  const int64_t T = x_in.size(0), K = x_in.size(1), N = y.size(1);
  const int64_t L = lora_a_in.size(0), R = lora_a_in.size(1);
  std::vector<Run> long_runs;
  const auto rows = adapter_rows(cu_seg_lens_in.contiguous(), seg_slots_in.contiguous(), T, L,
                                 long_runs);
  if ((rows.empty() && long_runs.empty()) || R == 0 || N == 0) return;
  const Isa isa = lora_isa_choice().get();
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor a = lora_a_in.contiguous(), b_t = lora_b_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  const bool in_place = y.scalar_type() == at::kFloat;
  at::Tensor acc = in_place ? y : y.to(at::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  float* yp = acc.data_ptr<float>();
  for (const Run& run : long_runs) {
    const at::Tensor shrink = at::mm(x.narrow(0, run.begin, run.end - run.begin),
                                     a[run.slot].t());
    acc.narrow(0, run.begin, run.end - run.begin).addmm_(shrink, b_t[run.slot], 1.0,
                                                         sp[run.slot]);
  }
  // The short runs' rows grouped by slot, up to kGroupRows a group: a group reads its slot's
  // A and B once (decode steps of several requests on one adapter).
  std::vector<std::pair<int64_t, int32_t>> sorted = rows;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& p, const auto& q) { return p.second < q.second; });
  std::vector<std::pair<int64_t, int64_t>> groups;  // [begin, end) in sorted
  for (int64_t i = 0; i < static_cast<int64_t>(sorted.size());) {
    int64_t j = i + 1;
    while (j < static_cast<int64_t>(sorted.size()) && j - i < kGroupRows &&
           sorted[j].second == sorted[i].second) {
      ++j;
    }
    groups.emplace_back(i, j);
    i = j;
  }
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> shrink(kGroupRows * R);
    const float* xs[kGroupRows];
    float* ys[kGroupRows];
    for (int64_t g = begin; g < end; ++g) {
      const auto [first, last] = groups[g];
      const int32_t slot = sorted[first].second;
      for (int64_t i = first; i < last; ++i) {
        xs[i - first] = xp + sorted[i].first * K;
        ys[i - first] = yp + sorted[i].first * N;
      }
      cpu::lora::add_rows_delta(isa, xs, last - first, K, ap + slot * R * K, R,
                                bp + slot * R * N, N, N, sp[slot], shrink.data(), ys);
    }
  });
  if (!in_place) y.copy_(acc);
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("lora_linear", &lora_linear_cpu); }

}  // namespace orca
