// interleave_rows16 / deinterleave_rows16 on CPU: a quantized weight's rows between the file's
// row layout and the x16 layout (orca/cpu/quant_rows16.h), done once at load by the model
// loader; the same bytes, permuted within each group of 16 rows.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quant_blocks.h"

namespace orca {
namespace {

template <bool kToGroup>
at::Tensor convert_rows16_cpu(const at::Tensor& qweight_in, c10::string_view format,
                              int64_t in_features) {
  const cpu::quant::Format fmt = parse_quant_format(format);
  check_dim(qweight_in, "qweight", 2, "[N, in_features / block_weights * block_bytes]");
  check_dtype(qweight_in, "qweight", at::kByte);
  TORCH_CHECK(qweight_in.device().is_cpu(), "qweight must be on the CPU, got ",
              qweight_in.device());
  check_block_rows(qweight_in, fmt, format, in_features, "in_features");
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, in_features);
  TORCH_CHECK(qweight_in.size(0) % cpu::quant::kRowGroup == 0, "qweight must have a multiple of ",
              cpu::quant::kRowGroup, " rows for the x16 layout, got ", qweight_in.size(0));
  const at::Tensor qweight = qweight_in.contiguous();
  at::Tensor out = at::empty_like(qweight);
  const int64_t groups = qweight.size(0) / cpu::quant::kRowGroup;
  const int64_t group_bytes = cpu::quant::kRowGroup * row_bytes;
  const uint8_t* in = qweight.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    cpu::quant::convert_rows16<kToGroup>(fmt, in + begin * group_bytes, in_features,
                                         (end - begin) * cpu::quant::kRowGroup,
                                         o + begin * group_bytes);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) {
  m.impl("interleave_rows16", &convert_rows16_cpu<true>);
  m.impl("deinterleave_rows16", &convert_rows16_cpu<false>);
}

}  // namespace orca
