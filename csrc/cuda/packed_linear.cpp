// packed_linear on CUDA: y = act(x @ W^T + b) over packed tokens, on the current stream.
//  - few tokens (T <= cuda::kSkinnyMaxT): one weight-streaming kernel with bias and
//    activation fused (csrc/include/orca/cuda/linear.cuh); silu_and_mul / gelu_tanh_and_mul
//    read the gate and up rows of each output column in the same CTA, so they are fully fused;
//  - otherwise cuBLASLt (torch's handle) with the bias/activation in its epilogue
//    (CUBLASLT_EPILOGUE_BIAS / GELU[_BIAS] / RELU[_BIAS]); a gated act runs the GEMM (bias in
//    the epilogue) into a [T, 2I] buffer and one vectorized act(gate) * up kernel. If cuBLASLt
//    finds no algorithm for an epilogue (or refuses it at run time), the GEMM runs plain and an
//    elementwise kernel applies bias and activation. Descriptors and algorithms are cached per
//    shape and host thread; the workspace is torch's per-stream cuBLASLt workspace.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <torch/library.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include <map>
#include <memory>
#include <tuple>
#include <type_traits>

// at::cuda::getCUDABlasLtWorkspace() (torch's per-stream workspace) exists from torch 2.7.
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 7)
#define ORCA_TORCH_LT_WORKSPACE 1
#else
#define ORCA_TORCH_LT_WORKSPACE 0
#endif

#include "checks.h"
#include "cuda/common.h"
#include "cuda/test_limits.h"

namespace orca {
namespace {

#define ORCA_LT_CHECK(expr)                                                                 \
  do {                                                                                      \
    const cublasStatus_t st_ = (expr);                                                      \
    TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "packed_linear: ", #expr, " failed with ",     \
                static_cast<int>(st_));                                                     \
  } while (0)

int alignment(const void* ptr) {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  int align = 16;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// One GEMM shape's cuBLASLt descriptors and algorithm, created on first use. Each host thread
// keeps its own (the bias pointer is set on the descriptor per call), so no lock is taken.
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // false: cuBLASLt has no algorithm (or refused it): take the fallback
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// device, dtype, epilogue, T, N, K, ldx, ldw, alignments of w / x / out / bias (0: no bias),
// workspace bytes.
using LtKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                         int, int, size_t>;
constexpr size_t kMaxCachedGemms = 4096;  // per thread; packed T takes many values

// The calling thread's descriptors + algorithm for `key`, created (with the heuristic query)
// on first use.
LtGemm& lt_gemm_for(const LtKey& key, cublasLtHandle_t handle) {
  thread_local std::map<LtKey, std::unique_ptr<LtGemm>> cache;
  if (const auto it = cache.find(key); it != cache.end()) return *it->second;
  if (cache.size() >= kMaxCachedGemms) cache.clear();
  const auto [device, dt_int, epi_int, T, N, K, ldx, ldw, align_w, align_x, align_o, align_b,
              ws] = key;
  (void)device;
  (void)align_b;
  const auto dt = static_cast<cudaDataType_t>(dt_int);
  const auto epilogue = static_cast<cublasLtEpilogue_t>(epi_int);
  auto g = std::make_unique<LtGemm>();
  ORCA_LT_CHECK(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  ORCA_LT_CHECK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                               sizeof(trans_a)));
  ORCA_LT_CHECK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                               sizeof(trans_b)));
  ORCA_LT_CHECK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                               sizeof(epilogue)));
  ORCA_LT_CHECK(cublasLtMatrixLayoutCreate(&g->a, dt, K, N, ldw));
  ORCA_LT_CHECK(cublasLtMatrixLayoutCreate(&g->b, dt, K, T, ldx));
  ORCA_LT_CHECK(cublasLtMatrixLayoutCreate(&g->c, dt, N, T, N));

  cublasLtMatmulPreference_t pref = nullptr;
  ORCA_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                        cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref_owner(pref, cublasLtMatmulPreferenceDestroy);
  ORCA_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t aw = align_w, ax = align_x, ao = align_o;
  ORCA_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw)));
  ORCA_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax)));
  ORCA_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ao, sizeof(ao)));
  ORCA_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ao, sizeof(ao)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, g->op, g->a, g->b, g->c,
                                                           g->c, pref, 1, &result, &found);
  g->usable = st == CUBLAS_STATUS_SUCCESS && found > 0;
  if (g->usable) g->algo = result.algo;
  return *cache.emplace(key, std::move(g)).first->second;
}

// The cuBLASLt workspace: torch's own for the current stream (cached per handle and stream)
// where this torch has it, else a block from the caching allocator.
struct LtWorkspace {
  void* ptr;
  size_t bytes;
  at::Tensor owner;  // set when allocated here
};
LtWorkspace lt_workspace(const at::Tensor& like) {
#if ORCA_TORCH_LT_WORKSPACE
  (void)like;
  return {at::cuda::getCUDABlasLtWorkspace(), at::cuda::getCUDABlasLtWorkspaceSize(), {}};
#else
  constexpr size_t kBytes = size_t{4} << 20;
  at::Tensor t = at::empty({static_cast<int64_t>(kBytes)}, like.options().dtype(at::kByte));
  return {t.data_ptr(), kBytes, t};
#endif
}

// out[T, N] (row-major, contiguous) = epilogue(x[T, K] @ w[N, K]^T). In cuBLAS's column-major
// terms: out^T [N, T] = op(A = w as [K, N], transposed) * (B = x as [K, T]). Returns false when
// cuBLASLt has no algorithm for this epilogue or refuses it (nothing was computed).
bool lt_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
             cublasLtEpilogue_t epilogue, at::Tensor& out) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  cudaDataType_t dt = CUDA_R_32F;
  if (x.scalar_type() == at::kBFloat16) dt = CUDA_R_16BF;
  else if (x.scalar_type() == at::kHalf) dt = CUDA_R_16F;
  const int device = x.get_device();
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const LtWorkspace workspace = lt_workspace(x);
  const LtKey key{device, static_cast<int>(dt), static_cast<int>(epilogue), T, N, K,
                  x.stride(0), w.stride(0), alignment(w.data_ptr()), alignment(x.data_ptr()),
                  alignment(out.data_ptr()), bias != nullptr ? alignment(bias->data_ptr()) : 0,
                  workspace.bytes};
  LtGemm& g = lt_gemm_for(key, handle);
  if (!g.usable) return false;
  if (bias != nullptr) {
    const void* bias_ptr = bias->data_ptr();
    ORCA_LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &bias_ptr, sizeof(bias_ptr)));
  }
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st =
      cublasLtMatmul(handle, g.op, &alpha, w.data_ptr(), g.a, x.data_ptr(), g.b, &beta,
                     out.data_ptr(), g.c, out.data_ptr(), g.c, &g.algo, workspace.ptr,
                     workspace.bytes, c10::cuda::getCurrentCUDAStream(device));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // the heuristic's algorithm refused: never again
    g.usable = false;
    return false;
  }
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "packed_linear: cublasLtMatmul failed with ",
              static_cast<int>(st));
  return true;
}

cublasLtEpilogue_t lt_epilogue(Activation act, bool has_bias) {
  switch (act) {
    case Activation::kGeluTanh: return has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    case Activation::kRelu: return has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    default: return has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

cuda::Act to_act(Activation act) {
  switch (act) {
    case Activation::kGeluTanh: return cuda::Act::kGeluTanh;
    case Activation::kRelu: return cuda::Act::kRelu;
    case Activation::kSiluAndMul: return cuda::Act::kSiluAndMul;
    case Activation::kGeluTanhAndMul: return cuda::Act::kGeluTanhAndMul;
    default: return cuda::Act::kNone;
  }
}

// out = act(x @ w^T + bias) with act in {none, gelu_tanh, relu}: cuBLASLt epilogue, or plain
// GEMM + elementwise kernel when cuBLASLt has no algorithm for the epilogue (or a test sets
// linear_no_epilogue in cuda/test_limits.h).
void gemm_epilogue(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                   Activation act, at::Tensor& out) {
  const bool fused = bias != nullptr || act != Activation::kNone;
  if ((!fused || !cuda::test_limits().linear_no_epilogue.load()) &&
      lt_gemm(x, w, bias, lt_epilogue(act, bias != nullptr), out)) {
    return;
  }
  if (!lt_gemm(x, w, nullptr, CUBLASLT_EPILOGUE_DEFAULT, out)) at::mm_out(out, x, w.t());
  if (bias == nullptr && act == Activation::kNone) return;
  ORCA_CUDA_LAUNCH_CHECK(
      cuda::launch_bias_act(out.data_ptr(), bias ? bias->data_ptr() : nullptr, out.size(0),
                            out.size(1), to_act(act), cuda::to_dtype(out.scalar_type()),
                            c10::cuda::getCurrentCUDAStream(out.get_device())),
      "packed_linear");
}

// A 2-D operand usable as-is: unit inner stride, leading dimension >= K, 16-bit/32-bit aligned.
at::Tensor gemm_operand(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, t.size(1)) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size() == 0;
  return ok ? t : t.contiguous();
}

// act(x @ weight^T + bias) on the current stream.
at::Tensor linear_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                       const std::optional<at::Tensor>& bias_in, Activation act) {
  const at::Tensor x = gemm_operand(x_in), w = gemm_operand(weight_in);
  const int64_t T = x.size(0), K = x.size(1), Nw = w.size(0);
  const bool glu = is_gated(act);
  const int64_t n_out = glu ? Nw / 2 : Nw;
  at::Tensor out = at::empty({T, n_out}, x.options());
  if (T == 0 || n_out == 0) return out;
  at::Tensor bias;
  if (bias_in) {
    bias = bias_in->contiguous();
    if (!cuda::aligned16(bias.data_ptr())) bias = bias.clone();
  }
  const at::Tensor* bias_ptr = bias.defined() ? &bias : nullptr;

  if (K == 0) {  // no products: act(bias) or act(0), computed with ATen ops
    at::Tensor y = bias.defined() ? bias.to(at::kFloat).unsqueeze(0).expand({T, Nw})
                                  : at::zeros({T, Nw}, x.options().dtype(at::kFloat));
    if (act == Activation::kGeluTanh) y = at::gelu(y, "tanh");
    else if (act == Activation::kRelu) y = at::relu(y);
    if (glu) {
      const at::Tensor gate = y.narrow(1, 0, n_out), up = y.narrow(1, n_out, n_out);
      y = (act == Activation::kSiluAndMul ? at::silu(gate) : at::gelu(gate, "tanh")) * up;
    }
    out.copy_(y);
    return out;
  }

  const cuda::DType dtype = cuda::to_dtype(x.scalar_type());
  const auto stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  const int64_t vec = 16 / x.element_size();
  if (T <= cuda::kSkinnyMaxT && K % vec == 0 && x.stride(0) % vec == 0 && w.stride(0) % vec == 0 &&
      cuda::aligned16(x.data_ptr()) && cuda::aligned16(w.data_ptr())) {
    cuda::SkinnyLinearParams p{};
    p.x = x.data_ptr();
    p.weight = w.data_ptr();
    p.bias = bias_ptr ? bias.data_ptr() : nullptr;
    p.out = out.data_ptr();
    p.T = T;
    p.N = n_out;
    p.K = K;
    p.x_stride = x.stride(0);
    p.w_stride = w.stride(0);
    p.act = to_act(act);
    ORCA_CUDA_LAUNCH_CHECK(cuda::launch_skinny_linear(p, dtype, stream), "packed_linear");
    return out;
  }
  if (!glu) {
    gemm_epilogue(x, w, bias_ptr, act, out);
    return out;
  }
  at::Tensor gate_up = at::empty({T, Nw}, x.options());
  gemm_epilogue(x, w, bias_ptr, Activation::kNone, gate_up);
  ORCA_CUDA_LAUNCH_CHECK(cuda::launch_act_and_mul(gate_up.data_ptr(), out.data_ptr(), T, n_out,
                                                  to_act(act), dtype, stream),
                         "packed_linear");
  return out;
}

// The input norm and the residual, where given, are ATen ops around the kernels (the CPU path
// fuses them: the norm on the calling thread, the residual in the epilogue).
at::Tensor packed_linear_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                              const std::optional<at::Tensor>& bias_in,
                              c10::string_view activation,
                              const std::optional<at::Tensor>& residual, c10::string_view norm,
                              const std::optional<at::Tensor>& norm_weight,
                              const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const auto [act, input_norm] = check_linear_inputs(
      x_in, weight_in, bias_in, activation, residual, norm, norm_weight, norm_bias, norm_eps);
  cuda::check_cuda(x_in, "packed_linear", "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor out = linear_cuda(
      input_norm.kind == NormKind::kNone ? x_in : normalize_rows(x_in, input_norm), weight_in,
      bias_in, act);
  return residual ? out.add_(*residual) : out;
}

// cuBLAS's GEMM with a float32 output (at::mm's out_dtype, which accumulates bfloat16 and
// float16 in float32) on the rows normalized as packed_linear normalizes them.
at::Tensor logits_linear_cuda(const at::Tensor& x_in, const at::Tensor& weight,
                              c10::string_view norm, const std::optional<at::Tensor>& norm_weight,
                              const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const InputNorm input_norm = check_linear_inputs(x_in, weight, std::nullopt, "none",
                                                   std::nullopt, norm, norm_weight, norm_bias,
                                                   norm_eps).norm;
  cuda::check_cuda(x_in, "logits_linear", "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = input_norm.kind == NormKind::kNone ? x_in : normalize_rows(x_in, input_norm);
  return x.scalar_type() == at::kFloat ? at::mm(x, weight.t())
                                       : at::mm(x, weight.t(), at::kFloat);
}

}  // namespace

TORCH_LIBRARY_IMPL(orca, CUDA, m) {
  m.impl("packed_linear", &packed_linear_cuda);
  m.impl("logits_linear", &logits_linear_cuda);
}

}  // namespace orca
