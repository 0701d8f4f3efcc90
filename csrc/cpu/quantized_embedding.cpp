// quantized_embedding on CPU: the rows ids of a table of GGUF blocks (any format and layout
// quantized_linear reads: a table tied to an output head in the x16 layout is read so too),
// dequantized to float32 one row at a time (the table itself stays quantized).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "quant_blocks.h"

namespace orca {
namespace {

at::Tensor quantized_embedding_cpu(const at::Tensor& ids_in, const at::Tensor& qweight_in,
                                   c10::string_view format, int64_t embedding_dim) {
  const QuantLayout layout = parse_quant_layout(format);
  const cpu::quant::Format fmt = layout.format;
  check_dim(ids_in, "ids", 1, "[T]");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt,
              "ids must be int64 or int32, got ", ids_in.scalar_type());
  check_dim(qweight_in, "qweight", 2,
            "[num_embeddings, embedding_dim / block_weights * block_bytes]");
  check_dtype(qweight_in, "qweight", at::kByte);
  TORCH_CHECK(qweight_in.device().is_cpu() && ids_in.device().is_cpu(),
              "quantized_embedding runs on the CPU; qweight is on ", qweight_in.device(),
              " and ids on ", ids_in.device());
  check_block_rows(qweight_in, fmt, format, embedding_dim, "embedding_dim");
  if (layout.rows16) check_rows16_rows(qweight_in, format, false);
  const int64_t row_bytes = cpu::quant::row_bytes(fmt, embedding_dim);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor qweight = qweight_in.contiguous();
  const int64_t T = ids.size(0), rows = qweight.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "ids[", t, "] = ", id[t],
                " is out of range for a table of ", rows, " rows");
  }
  at::Tensor out = at::empty({T, embedding_dim}, qweight.options().dtype(at::kFloat));
  if (T == 0 || embedding_dim == 0) return out;
  const cpu::quant::Isa isa = quant_isa_choice().get();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  // A row per task is ~2 KB of writes: only long prompts are worth the threads.
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> file_row(layout.rows16 ? row_bytes : 0);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = w + id[t] * row_bytes;
      if (layout.rows16) {
        cpu::quant::file_row_of_rows16(fmt, w, embedding_dim, id[t], file_row.data());
        row = file_row.data();
      }
      cpu::quant::dequantize_rows(isa, fmt, row, embedding_dim, 1, o + t * embedding_dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CPU, m) { m.impl("quantized_embedding", &quantized_embedding_cpu); }

}  // namespace orca
