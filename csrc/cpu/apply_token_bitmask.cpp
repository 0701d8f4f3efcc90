// apply_token_bitmask on CPU: masks are split across the intra-op threads; within a row, a word
// whose 32 bits are all set (the common case for a permissive grammar) is skipped whole.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "checks.h"

namespace orca {
namespace {

template <typename scalar_t>
void mask_row(scalar_t* row, const int32_t* words, int64_t vocab) {
  const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xffffffffu) continue;
    const int64_t end = std::min<int64_t>(32, vocab - w * 32);
    for (int64_t b = 0; b < end; ++b) {
      if (!((word >> b) & 1u)) row[w * 32 + b] = neg_inf;
    }
  }
}

void apply_token_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask,
                             const std::optional<at::Tensor>& indices) {
  check_token_bitmask_inputs(logits, bitmask, indices);
  const int64_t num_masks = bitmask.size(0), num_rows = logits.size(0);
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  const at::Tensor rows = indices ? indices->contiguous() : at::Tensor();
  const int64_t* row_of = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; row_of != nullptr && i < num_masks; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < num_rows, "indices[", i, "] = ", row_of[i],
                " is outside logits' ", num_rows, " rows");
  }
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  ORCA_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    at::parallel_for(0, num_masks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = row_of ? row_of[i] : i;
        mask_row(base + row * stride, mask + i * words, vocab);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask_cpu); }

}  // namespace orca
