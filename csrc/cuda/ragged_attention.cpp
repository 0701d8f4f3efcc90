// ragged_attention on CUDA. Validates shapes, dtypes and devices only: checking metadata values
// (monotone cu_q_lens, block ids in range, context_lens vs the block table) would need a
// device-to-host copy and a sync per call, which would also forbid CUDA-graph capture. The
// kernels clamp every metadata value into range and never dereference an out-of-range block
// id (such KV positions read as zeros), so bad metadata gives unspecified output but no
// out-of-bounds access. The CPU implementation checks the values and raises.
//
// The work partition is planned from shapes alone (orca::cuda::plan_attention): no device
// tensor is read on the host, and each call is one attention launch, plus one merge launch when
// the plan splits long KV ranges (a CPU step plan from plan_attention is not taken). Tests cap
// the tensor-core grid and the KV splits through cuda/test_limits.h.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "checks.h"
#include "cuda/common.h"
#include "cuda/test_limits.h"

namespace orca {
namespace {

at::Tensor ragged_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& cu_q_lens_in,
                                 const at::Tensor& context_lens_in,
                                 const at::Tensor& block_table_in, double scale,
                                 int64_t window, const std::optional<at::Tensor>& step_plan) {
  TORCH_CHECK(!step_plan.has_value(), "ragged_attention: plan is a CPU step plan "
              "(plan_attention); on CUDA the op plans from shapes alone, pass plan=None");
  const AttentionShape s = check_attention_inputs(q_in, k_cache, v_cache, cu_q_lens_in,
                                                  context_lens_in, block_table_in, scale, window);
  cuda::check_cuda(q_in, "ragged_attention", "q");
  const c10::cuda::CUDAGuard guard(q_in.device());
  TORCH_CHECK(s.num_tokens * s.num_q_heads < std::numeric_limits<int32_t>::max() / 64 &&
                  s.batch < std::numeric_limits<int32_t>::max() / 2 &&
                  s.max_blocks < std::numeric_limits<int32_t>::max(),
              "ragged_attention: problem too large for 32-bit indexing");

  at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor cu_q_lens = cu_q_lens_in.contiguous();
  const at::Tensor context_lens = context_lens_in.contiguous();
  const at::Tensor block_table = block_table_in.contiguous();
  at::Tensor out = at::empty({s.num_tokens, s.num_q_heads, s.head_dim}, q.options());
  if (s.num_tokens == 0) return out;
  if (s.batch == 0 || s.num_blocks == 0) return out.zero_();  // no request owns a token

  const cuda::DType dtype = cuda::to_dtype(q.scalar_type());
  const cuda::KvFormat kv_format =
      is_fp8_kv_cache(k_cache) ? cuda::KvFormat::kFp8E4M3 : cuda::KvFormat::kSameAsQ;
  auto q_aligned = [&](const at::Tensor& t) {
    return cuda::aligned16(t.data_ptr()) && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0;
  };
  const bool tc_shape = dtype != cuda::DType::kFloat32 &&
                        cuda::attention_tc_head_dim(static_cast<int>(s.head_dim));
  if (tc_shape && !q_aligned(q)) q = q.contiguous();
  const bool aligned = q_aligned(q) && cuda::aligned16(k_cache.data_ptr()) &&
                       cuda::aligned16(v_cache.data_ptr());

  const int device = q.get_device();
  const int num_sms = cuda::device_attribute(cudaDevAttrMultiProcessorCount, device);
  cuda::AttentionLimits limits;
  limits.max_ctas = cuda::test_limits().attn_max_ctas.load();
  limits.max_splits = static_cast<int32_t>(cuda::test_limits().attn_max_splits.load());
  cuda::AttentionPlan plan =
      cuda::plan_attention(s.num_tokens, s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim,
                           s.block_size, s.max_blocks, dtype, kv_format, aligned, num_sms,
                           limits);
  if (plan.tensor_cores &&
      plan.smem_bytes > static_cast<size_t>(cuda::device_attribute(
                            cudaDevAttrMaxSharedMemoryPerBlockOptin, device))) {
    plan = cuda::plan_attention(s.num_tokens, s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim,
                                s.block_size, s.max_blocks, dtype, kv_format,
                                /*aligned16=*/false, num_sms, limits);
  }

  // Split partials: part_o [rows, D], part_lse [rows], then the merge kernel's KV chunk (an
  // int32 in the last float) in one allocation.
  at::Tensor workspace;
  if (plan.partial_rows > 0) {
    workspace = at::empty({plan.partial_rows * (s.head_dim + 1) + 1},
                          q.options().dtype(at::kFloat));
  }

  cuda::AttentionParams p{};
  p.q = q.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  if (workspace.defined()) {
    p.part_o = workspace.data_ptr<float>();
    p.part_lse = p.part_o + plan.partial_rows * s.head_dim;
    p.split_chunk = reinterpret_cast<int32_t*>(p.part_lse + plan.partial_rows);
  }
  p.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.num_blocks = s.num_blocks;
  p.num_tokens = static_cast<int32_t>(s.num_tokens);
  p.batch = static_cast<int32_t>(s.batch);
  p.num_q_heads = static_cast<int32_t>(s.num_q_heads);
  p.num_kv_heads = static_cast<int32_t>(s.num_kv_heads);
  p.head_dim = static_cast<int32_t>(s.head_dim);
  p.block_size = static_cast<int32_t>(s.block_size);
  p.max_blocks = static_cast<int32_t>(s.max_blocks);
  p.block_shift = cuda::block_size_shift(s.block_size);
  p.max_context = cuda::attention_max_context(s.block_size, s.max_blocks);
  p.max_splits = plan.max_splits;
  // A window as long as the longest context the table holds hides no key: none.
  p.window = window < p.max_context ? static_cast<int32_t>(window) : 0;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  ORCA_CUDA_LAUNCH_CHECK(cuda::launch_ragged_attention(p, plan, dtype,
                                                       c10::cuda::getCurrentCUDAStream(device)),
                         "ragged_attention");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) { m.impl("ragged_attention", &ragged_attention_cuda); }

}  // namespace orca
