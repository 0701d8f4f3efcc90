// The merge of a split item's partials (orca/cpu/attention.h), by log-sum-exp.
#pragma once

#include "orca/cpu/attention_common.h"

namespace orca::cpu {

// Combines num_splits consecutive partial blocks (split-major) of one work item's rows into
// its normalized output.
template <typename scalar_t>
void merge_partials(const AttentionArgs<scalar_t>& a, const AttentionWork& first,
                    int64_t num_splits, const Partials& part) {
  const int64_t D = a.head_dim;
  const int64_t rows = first.num_rows(a.num_q_heads / a.num_kv_heads);
  std::vector<float> out(D);
  for (int64_t row = 0; row < rows; ++row) {
    float m_max = kNegInf;
    for (int64_t s = 0; s < num_splits; ++s) {
      m_max = std::max(m_max, part.m[first.partial_row + s * rows + row]);
    }
    std::fill(out.begin(), out.end(), 0.f);
    float l_total = 0.f;
    for (int64_t s = 0; s < num_splits; ++s) {
      const int64_t prow = first.partial_row + s * rows + row;
      if (part.m[prow] == kNegInf) continue;  // no visible KV in this split
      const float weight = fast_exp(part.m[prow] - m_max);
      l_total += weight * part.l[prow];
      const float* o = part.o + prow * D;
      for (int64_t d = 0; d < D; ++d) out[d] += weight * o[d];
    }
    const RowPlace at = row_place(a, first, row);
    const float inv = 1.f / l_total;
    scalar_t* dst = a.out + (at.token * a.num_q_heads + at.q_head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(out[d] * inv);
  }
}

}  // namespace orca::cpu
