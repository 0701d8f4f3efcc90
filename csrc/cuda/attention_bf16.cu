// bf16 instantiation of the ragged_attention kernels (one dtype per translation unit so the
// build can compile them in parallel).
#include "attention_launch.cuh"

namespace orca::cuda::attn {
template cudaError_t launch_attention<__nv_bfloat16>(const AttentionParams&, const AttentionPlan&,
                                                     cudaStream_t);
}  // namespace orca::cuda::attn
