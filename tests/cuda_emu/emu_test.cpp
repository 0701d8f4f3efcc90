// Executes the orca CUDA kernels (csrc/include/orca/cuda/*.cuh) on the CPU through the SIMT
// emulation in orca_cuda_emulate.h and compares them with double-precision references.
// Built and run by tests/test_cuda_emu.py; exits non-zero on a mismatch.
//   emu_test [attention|attention_items|store_kv|fp8|linear|lora|all]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "orca/cuda/attention.cuh"
#include "orca/cuda/linear.cuh"
#include "orca/cuda/lora.cuh"
#include "orca/cuda/store_kv.cuh"

using namespace orca::cuda;

namespace {

int g_failures = 0;
std::mt19937 g_rng(1234);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }
int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g_rng); }

template <typename T> T cast(float v);
template <> float cast<float>(float v) { return v; }
template <> __half cast<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __nv_fp8_e4m3 cast<__nv_fp8_e4m3>(float v) { return __nv_fp8_e4m3(v); }
float back(float v) { return v; }
float back(__half v) { return __half2float(v); }
float back(__nv_bfloat16 v) { return __bfloat162float(v); }
float back(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

template <typename T> DType dtype_of();
template <> DType dtype_of<float>() { return DType::kFloat32; }
template <> DType dtype_of<__half>() { return DType::kFloat16; }
template <> DType dtype_of<__nv_bfloat16>() { return DType::kBFloat16; }
template <typename T> const char* name_of();
template <> const char* name_of<float>() { return "fp32"; }
template <> const char* name_of<__half>() { return "fp16"; }
template <> const char* name_of<__nv_bfloat16>() { return "bf16"; }

template <typename T> float tolerance();
template <> float tolerance<float>() { return 2e-5f; }
template <> float tolerance<__half>() { return 4e-3f; }
template <> float tolerance<__nv_bfloat16>() { return 2.5e-2f; }

void report(const std::string& what, double err, double tol, bool extra_ok = true) {
  const bool ok = err <= tol && extra_ok;
  std::printf("%s %-70s max_err=%.3g tol=%.3g\n", ok ? "PASS" : "FAIL", what.c_str(), err, tol);
  if (!ok) ++g_failures;
  std::fflush(stdout);
}

// ---- ragged_attention ----------------------------------------------------------------------

struct AttnCase {
  int Hq, Hkv, D, block_size, extra_blocks;
  std::vector<int> q_lens, ctx;
  int num_sms;
  bool bad_block = false;  // put an out-of-range id in a used block_table entry
  bool corrupt = false;    // garbage metadata: only memory safety is checked (run under ASan)
  int table_pad = 0;       // junk block-table columns past the longest context (as for graphs)
  AttentionLimits limits{};  // grid / split caps (the tests' attn_max_ctas / attn_max_splits)
  int window = 0;            // sliding window (0: none)
};

template <typename T, int D, typename KV>
void run_tc(const AttentionParams& p, const AttentionPlan& plan) {
  const dim3 grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(p.num_kv_heads));
  if (plan.warps_m == 1) {
    orca_emu::launch(grid, dim3(kAttnThreads), plan.smem_bytes,
                     [&] { attn::attention_tc_kernel<T, D, 1, KV>(p); });
  } else {
    orca_emu::launch(grid, dim3(kAttnThreads), plan.smem_bytes,
                     [&] { attn::attention_tc_kernel<T, D, 4, KV>(p); });
  }
  if (plan.max_splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
    orca_emu::launch(dim3(static_cast<unsigned>((rows + 3) / 4)), dim3(128), 0,
                     [&] { attn::merge_kernel<T>(p); });
  }
}

template <typename T, typename KV>
void run_attention(const AttentionParams& p, const AttentionPlan& plan) {
  if constexpr (!std::is_same_v<T, float>) {
    if (plan.tensor_cores) {
      switch (p.head_dim) {
        case 32: return run_tc<T, 32, KV>(p, plan);
        case 64: return run_tc<T, 64, KV>(p, plan);
        case 80: return run_tc<T, 80, KV>(p, plan);
        case 96: return run_tc<T, 96, KV>(p, plan);
        case 128: return run_tc<T, 128, KV>(p, plan);
        default: break;
      }
    }
  }
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  orca_emu::launch(dim3(static_cast<unsigned>((rows + 3) / 4)), dim3(128), 0,
                   [&] { attn::attention_simple_kernel<T, KV>(p); });
}

// One case's inputs, built once so that several plans can run on the same data; the cache
// holds KV values (T's, or fp8 e4m3).
template <typename T, typename KV = T>
struct AttnData {
  int B = 0, T_ = 0, max_blocks = 1, NB = 0, q_heads_stride = 0, bad_r = -1;
  std::vector<int> cu, ctx;
  std::vector<int32_t> table;
  std::vector<T> q;
  std::vector<KV> k, v;
  float scale = 0;
};

template <typename T, typename KV = T>
AttnData<T, KV> make_attention_data(const AttnCase& c) {
  AttnData<T, KV> d;
  d.B = static_cast<int>(c.q_lens.size());
  const int B = d.B, bs = c.block_size;
  d.cu.assign(B + 1, 0);
  for (int r = 0; r < B; ++r) d.cu[r + 1] = d.cu[r] + c.q_lens[r];
  d.T_ = d.cu[B];
  int total_blocks = 0;
  for (int r = 0; r < B; ++r) {
    const int nb = (c.ctx[r] + bs - 1) / bs;
    d.max_blocks = std::max(d.max_blocks, nb);
    total_blocks += nb;
  }
  d.max_blocks += c.table_pad;
  d.NB = total_blocks + c.extra_blocks;
  // Physical blocks: a random permutation handed out in order.
  std::vector<int> perm(d.NB);
  for (int i = 0; i < d.NB; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g_rng);
  d.table.assign(static_cast<size_t>(B) * d.max_blocks, -7);  // unused: junk ids
  int next = 0;
  for (int r = 0; r < B; ++r) {
    const int nb = (c.ctx[r] + bs - 1) / bs;
    for (int j = 0; j < nb; ++j) d.table[r * d.max_blocks + j] = perm[next++];
  }
  if (c.bad_block) {
    d.bad_r = B - 1;
    d.table[d.bad_r * d.max_blocks] = d.NB + 1000;
  }
  d.ctx = c.ctx;
  if (c.corrupt) {  // contexts past the table, negative, offsets past T, q_len > ctx, bad ids
    d.ctx[0] = 1 << 29;
    if (B > 1) d.ctx[1] = -5;
    d.cu[1] = d.T_ + 100;
    if (B > 2) d.cu[2] = 1;
    d.table[0] = d.NB + 5;
    d.table[d.max_blocks - 1] = -100;
  }
  // q is a strided view: rows of [Hq + 2 Hkv] heads (like a fused QKV projection).
  d.q_heads_stride = c.Hq + 2 * c.Hkv;
  d.q.resize(static_cast<size_t>(d.T_) * d.q_heads_stride * c.D);
  for (auto& x : d.q) x = cast<T>(uniform(-1.f, 1.f));
  d.k.resize(static_cast<size_t>(d.NB) * bs * c.Hkv * c.D);
  d.v.resize(d.k.size());
  for (auto& x : d.k) x = cast<KV>(uniform(-1.f, 1.f));
  for (auto& x : d.v) x = cast<KV>(uniform(-1.f, 1.f));
  d.scale = 1.f / std::sqrt(static_cast<float>(c.D)) * 2.f;  // peakier softmax
  return d;
}

// Runs the kernels as the launcher would for `limits`; returns the output and the plan.
template <typename T, typename KV>
std::vector<T> run_attention_case(const AttnCase& c, const AttnData<T, KV>& d,
                                  const AttentionLimits& limits, AttentionPlan* plan_out) {
  const AttentionPlan plan =
      plan_attention(d.T_, d.B, c.Hq, c.Hkv, c.D, c.block_size, d.max_blocks, dtype_of<T>(),
                     attn::kv_format_of<T, KV>(),
                     /*aligned16=*/true, c.num_sms, limits);
  std::vector<T> out(static_cast<size_t>(d.T_) * c.Hq * c.D, cast<T>(NAN));
  // The launcher's workspace: part_o, part_lse, then the KV chunk (poisoned with NaNs).
  std::vector<float> work(static_cast<size_t>(plan.partial_rows) * (c.D + 1) + 1, NAN);
  AttentionParams p{};
  p.q = d.q.data();
  p.q_stride_token = static_cast<int64_t>(d.q_heads_stride) * c.D;
  p.q_stride_head = c.D;
  p.k_cache = d.k.data();
  p.v_cache = d.v.data();
  p.out = out.data();
  if (plan.partial_rows > 0) {
    p.part_o = work.data();
    p.part_lse = p.part_o + plan.partial_rows * c.D;
    p.split_chunk = reinterpret_cast<int32_t*>(p.part_lse + plan.partial_rows);
  }
  p.cu_q_lens = d.cu.data();
  p.context_lens = d.ctx.data();
  p.block_table = d.table.data();
  p.num_blocks = d.NB;
  p.num_tokens = d.T_;
  p.batch = d.B;
  p.num_q_heads = c.Hq;
  p.num_kv_heads = c.Hkv;
  p.head_dim = c.D;
  p.block_size = c.block_size;
  p.max_blocks = d.max_blocks;
  p.block_shift = block_size_shift(c.block_size);
  p.max_context = attention_max_context(c.block_size, d.max_blocks);
  p.max_splits = plan.max_splits;
  p.window = c.window < p.max_context ? c.window : 0;  // as the launcher sets it
  p.scale_log2 = d.scale * 1.4426950408889634f;
  run_attention<T, KV>(p, plan);
  if (plan_out != nullptr) *plan_out = plan;
  return out;
}

// Largest |out - reference| over the compared requests (those without the bad block);
// infinity when an output is not finite.
template <typename T, typename KV>
double attention_error(const AttnCase& c, const AttnData<T, KV>& d, const std::vector<T>& out) {
  const int g = c.Hq / c.Hkv, bs = c.block_size, D = c.D;
  double max_err = 0;
  for (int r = 0; r < d.B; ++r) {
    if (r == d.bad_r) continue;
    for (int i = 0; i < c.q_lens[r]; ++i) {
      const int t = d.cu[r] + i, pos = c.ctx[r] - c.q_lens[r] + i;
      for (int hq = 0; hq < c.Hq; ++hq) {
        const int h = hq / g;
        const T* qrow = d.q.data() + (static_cast<size_t>(t) * d.q_heads_stride + hq) * D;
        // Keys (pos - window, pos], or all up to pos.
        const int j0 = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;
        std::vector<double> s(pos + 1);
        double mx = -1e300;
        for (int j = j0; j <= pos; ++j) {
          const int blk = d.table[r * d.max_blocks + j / bs];
          const KV* krow = d.k.data() + ((static_cast<size_t>(blk) * bs + j % bs) * c.Hkv + h) * D;
          double dot = 0;
          for (int e = 0; e < D; ++e) dot += static_cast<double>(back(qrow[e])) * back(krow[e]);
          s[j] = dot * d.scale;
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int j = j0; j <= pos; ++j) l += (s[j] = std::exp(s[j] - mx));
        for (int e = 0; e < D; ++e) {
          double o = 0;
          for (int j = j0; j <= pos; ++j) {
            const int blk = d.table[r * d.max_blocks + j / bs];
            o += s[j] * back(d.v[((static_cast<size_t>(blk) * bs + j % bs) * c.Hkv + h) * D + e]);
          }
          const float got = back(out[(static_cast<size_t>(t) * c.Hq + hq) * D + e]);
          if (!std::isfinite(got)) return INFINITY;
          max_err = std::max(max_err, std::abs(got - o / l));
        }
      }
    }
  }
  return max_err;
}

template <typename T, typename KV>
std::string plan_label(const AttnCase& c, const AttnData<T, KV>& d, const AttentionPlan& plan) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "D=%d Hq=%d Hkv=%d bs=%d B=%d T=%d %s%s splits<=%d grid=%lld window=%d", c.D,
                c.Hq, c.Hkv, c.block_size, d.B, d.T_,
                plan.tensor_cores ? (plan.warps_m == 1 ? "tc-decode" : "tc-prefill") : "simple",
                !std::is_same_v<T, float> && !plan.tensor_cores ? "(!)" : "", plan.max_splits,
                static_cast<long long>(plan.grid_x), c.window);
  return buf;
}

template <typename T, typename KV = T>
void test_attention(const AttnCase& c, const std::string& label) {
  const AttnData<T, KV> d = make_attention_data<T, KV>(c);
  AttentionPlan plan;
  const std::vector<T> out = run_attention_case(c, d, c.limits, &plan);
  const std::string what = "attention " + std::string(name_of<T>()) +
                           (std::is_same_v<KV, T> ? "" : " fp8-cache") + " " + label + " ";
  if (c.corrupt) {
    report(what + "(ran; memory safety only)", 0, 0);
    return;
  }
  // Positions of the bad block must not crash; their value is unspecified, so requests
  // touching it are not compared.
  report(what + plan_label(c, d, plan), attention_error(c, d, out), tolerance<T>());
}

// The work partition must not change a single output bit: the same data through a padded
// block table, a capped grid (several items per CTA, in another order) and the uncapped plan.
// Each item is computed by one CTA alone, so any difference would be a race or a partition bug.
template <typename T>
void test_attention_partition_invariance(AttnCase c, const std::string& label,
                                         std::vector<int64_t> grid_caps) {
  const AttnData<T> d = make_attention_data<T>(c);
  AttentionPlan plan;
  const std::vector<T> base = run_attention_case(c, d, {}, &plan);
  report("attention " + std::string(name_of<T>()) + " " + label + " " + plan_label(c, d, plan),
         attention_error(c, d, base), tolerance<T>());
  const auto bits_differ = [&](const std::vector<T>& other) {
    return std::memcmp(other.data(), base.data(), base.size() * sizeof(T)) != 0;
  };
  for (int64_t cap : grid_caps) {
    AttentionPlan capped;
    const std::vector<T> out = run_attention_case(c, d, {cap, 0}, &capped);
    report("attention " + std::string(name_of<T>()) + " " + label + " grid " +
               std::to_string(capped.grid_x) + " == uncapped bit for bit",
           bits_differ(out) ? 1.0 : 0.0, 0);
  }
  // The same requests through a table padded with junk columns: same chunks, same bits.
  AttnCase padded = c;
  padded.table_pad = 300;
  AttnData<T> dp = d;
  dp.max_blocks = d.max_blocks + padded.table_pad;
  dp.table.assign(static_cast<size_t>(d.B) * dp.max_blocks, 123456);
  for (int r = 0; r < d.B; ++r)
    std::copy(d.table.begin() + r * d.max_blocks, d.table.begin() + (r + 1) * d.max_blocks,
              dp.table.begin() + r * dp.max_blocks);
  AttentionPlan wide;
  const std::vector<T> out = run_attention_case(padded, dp, {}, &wide);
  report("attention " + std::string(name_of<T>()) + " " + label + " table +300 columns (splits<=" +
             std::to_string(wide.max_splits) + ") == tight bit for bit",
         bits_differ(out) ? 1.0 : 0.0, 0);
}

AttnCase windowed(AttnCase c, int window) {
  c.window = window;
  return c;
}

// Sliding windows: 1 and 3 (a query sees itself and its last keys), windows that skip whole
// splits and KV tiles, and ones longer than every context (the same as none).
template <typename T>
void window_suite() {
  const AttnCase mixed{8, 2, 64, 3, 2, {37, 1, 1, 70, 1}, {37, 90, 5, 200, 260}, 1};
  const AttnCase decode{4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132};
  for (int window : {1, 3, 64}) test_attention<T>(windowed(mixed, window), "window mixed");
  for (int window : {3, 512, 5000}) test_attention<T>(windowed(decode, window), "window decode");
  // Spans of 600 split in two; the same unsplit and on a one-CTA grid.
  test_attention<T>(windowed(decode, 600), "window decode-split");
  AttnCase unsplit = windowed(decode, 600), one_cta = windowed(decode, 600);
  unsplit.limits = {0, 1};
  one_cta.limits = {1, 0};
  test_attention<T>(unsplit, "window decode no-split");
  test_attention<T>(one_cta, "window decode-split one CTA");
  // Decode tiles of several queries (4 tokens x 4 heads) over split spans.
  test_attention<T>({4, 1, 64, 16, 0, {4, 1, 1}, {1300, 700, 40}, 132, false, false, 0, {}, 600},
                    "window multi-token decode");
  // A long prefill over cached KV: later row tiles skip the first split, and their rows' merges
  // start past it.
  test_attention<T>({2, 1, 64, 16, 0, {600, 1}, {1200, 90}, 132, false, false, 0, {}, 100},
                    "window prefill-split");
  // Chunked prefill with block size 1, MQA decode with a wide group, empty requests.
  test_attention<T>(windowed({2, 2, 96, 1, 5, {20, 3}, {600, 530}, 132}, 300),
                    "window prefill bs=1");
  test_attention<T>(windowed({32, 1, 64, 16, 0, {1, 1}, {90, 600}, 132}, 50),
                    "window mqa decode g=32");
  test_attention<T>(windowed({4, 2, 64, 16, 0, {1, 0, 1, 2}, {33, 0, 1, 700}, 132}, 5),
                    "window empty requests");
  test_attention<T>(windowed({4, 1, 64, 4, 0, {70, 1, 30}, {70, 900, 40}, 132, false, true}, 9),
                    "window corrupt");
}

template <typename T>
void attention_suite() {
  // Mixed prefill + decode, GQA, odd block size, no split (many SMs' worth of tiles).
  test_attention<T>({8, 2, 64, 3, 2, {37, 1, 1, 70, 1}, {37, 90, 5, 200, 260}, 1}, "mixed");
  // Decode batch, long contexts: split KV + merge.
  test_attention<T>({4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132}, "decode-split");
  // The same unsplit (max_splits = 1) and on a one-CTA grid (max_ctas = 1).
  test_attention<T>({4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132, false, false, 0, {0, 1}},
                    "decode no-split");
  test_attention<T>({4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132, false, false, 0, {1, 0}},
                    "decode-split one CTA");
  // Prefill with KV already cached (chunked prefill) split over KV, block_size 1.
  test_attention<T>({2, 2, 96, 1, 5, {20, 3}, {600, 530}, 132}, "prefill-split bs=1");
  // Head dims 32 and 80, MQA group of 8, mixed.
  test_attention<T>({8, 1, 32, 16, 1, {5, 1, 17}, {300, 77, 17}, 132}, "mqa");
  test_attention<T>({4, 2, 80, 8, 0, {1, 1, 1, 1}, {64, 65, 129, 1}, 132}, "decode-edges");
  test_attention<T>({2, 1, 64, 4, 0, {40, 1}, {40, 513}, 132}, "prefill+decode split");
  // Out-of-range block id: must not crash or touch other requests.
  test_attention<T>({4, 2, 64, 16, 0, {3, 1}, {40, 300}, 132, true}, "bad block id");
  // MQA decode with a group larger than a decode tile (two 16-row tiles per request).
  test_attention<T>({32, 1, 64, 16, 0, {1, 1}, {90, 600}, 132}, "mqa decode g=32");
  // A short decode behind a block table padded far past it (as for CUDA graphs): the chunk
  // follows the contexts, not the table.
  test_attention<T>({4, 1, 64, 16, 0, {1, 1}, {600, 20}, 132, false, false, 2000}, "padded table");
  // Empty requests (q_len 0, or context 0 as in padded graph batches) between real ones.
  test_attention<T>({4, 2, 64, 16, 0, {1, 0, 1, 2}, {33, 0, 1, 700}, 132}, "empty requests");
  // Garbage metadata on every path.
  test_attention<T>({4, 2, 64, 16, 0, {3, 1, 2}, {40, 300, 2}, 132, false, true}, "corrupt decode");
  test_attention<T>({4, 1, 64, 4, 0, {70, 1, 30}, {70, 900, 40}, 132, false, true}, "corrupt prefill");
  test_attention<T>({4, 1, 64, 4, 0, {70, 1, 30}, {70, 900, 40}, 1, false, true}, "corrupt no-split");
  window_suite<T>();
}

// Batches past one request per thread (B > 128: the prefix scan's multi-request ranges) and
// many items per CTA, for one dtype (the emulator runs 128 OS threads per CTA).
void attention_many_items_suite() {
  std::vector<int> q1(300, 1), ctx300(300);
  for (int r = 0; r < 300; ++r) ctx300[r] = 1 + (r * 37) % 90;
  ctx300[7] = 900;  // one long request: splits in a batch of short ones
  test_attention_partition_invariance<__nv_bfloat16>({2, 1, 32, 16, 0, q1, ctx300, 1},
                                                     "B=300 decode", {1, 7});
  std::vector<int> q129(129, 1), ctx129(129, 5);
  q129[128] = 40;
  ctx129[128] = 600;
  test_attention_partition_invariance<__half>({4, 1, 32, 8, 0, q129, ctx129, 132},
                                              "B=129 decode+prefill", {2});
  test_attention_partition_invariance<__nv_bfloat16>(
      {4, 2, 64, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132}, "decode-split", {1, 3});
  test_attention_partition_invariance<__nv_bfloat16>(
      {8, 2, 64, 16, 0, {100, 1, 70}, {100, 520, 300}, 132}, "prefill", {1, 2});
  test_attention_partition_invariance<__nv_bfloat16>(
      windowed({4, 2, 64, 16, 0, {1, 1, 60}, {700, 1300, 800}, 132}, 600), "window", {1, 3});
}

// ---- store_kv ----------------------------------------------------------------------------------

// store_kv's parameters for Tn tokens of H heads x D values of T, key and value views into
// token rows stride_t values apart (value D values in), caches of `slots` rows of cache_elem bytes
// per value.
template <typename T>
StoreKvParams store_kv_params(const std::vector<T>& key, const std::vector<T>& value,
                              void* k_cache, void* v_cache, const std::vector<int64_t>& slot,
                              int slots, int H, int D, int stride_t, int cache_elem) {
  StoreKvParams p{};
  p.key = key.data();
  p.value = value.data() + D;  // offset view
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.slot_mapping = slot.data();
  p.num_tokens = static_cast<int64_t>(slot.size());
  p.num_slots = slots;
  p.num_heads = H;
  p.row_bytes = static_cast<int64_t>(D) * cache_elem;
  p.key_stride_token = p.value_stride_token = stride_t * sizeof(T);
  p.key_stride_head = p.value_stride_head = D * sizeof(T);
  return p;
}

template <typename T>
void test_store_kv(int vb) {
  const int Tn = 9, H = 3, D = 40, slots = 32;
  const int stride_t = (H + 2) * D;  // key/value are views into a wider buffer
  std::vector<T> key(static_cast<size_t>(Tn) * stride_t), value(key.size());
  for (auto& v : key) v = cast<T>(uniform(-1, 1));
  for (auto& v : value) v = cast<T>(uniform(-1, 1));
  std::vector<T> kc(static_cast<size_t>(slots) * H * D, cast<T>(0.5f)), vc(kc.size(), cast<T>(0.5f));
  const std::vector<int64_t> slot = {3, -1, 31, 0, 1000, 7, -5, 12, 2};
  const StoreKvParams p = store_kv_params(key, value, kc.data(), vc.data(), slot, slots, H, D,
                                          stride_t, sizeof(T));
  if (vb == 16) orca_emu::launch(dim3(Tn), dim3(64), 0, [&] { kvstore::store_kv_kernel<16>(p); });
  else if (vb == 8) orca_emu::launch(dim3(Tn), dim3(64), 0, [&] { kvstore::store_kv_kernel<8>(p); });
  else if (vb == 4) orca_emu::launch(dim3(Tn), dim3(64), 0, [&] { kvstore::store_kv_kernel<4>(p); });
  else orca_emu::launch(dim3(Tn), dim3(64), 0, [&] { kvstore::store_kv_kernel<2>(p); });
  double err = 0;
  for (int s = 0; s < slots; ++s) {
    int src = -1;
    for (int t = 0; t < Tn; ++t)
      if (slot[t] == s) src = t;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        const float ek = src < 0 ? 0.5f : back(key[src * stride_t + h * D + d]);
        const float ev = src < 0 ? 0.5f : back(value[src * stride_t + D + h * D + d]);
        err = std::max<double>(err, std::abs(back(kc[(s * H + h) * D + d]) - ek));
        err = std::max<double>(err, std::abs(back(vc[(s * H + h) * D + d]) - ev));
      }
  }
  report(std::string("store_kv ") + name_of<T>() + " vec=" + std::to_string(vb), err, 0);
}

// The fp8 e4m3 cache: every path against the float64 attention over the cache's values.
template <typename T>
void fp8_cache_suite() {
  using F8 = __nv_fp8_e4m3;
  test_attention<T, F8>({8, 2, 64, 3, 2, {37, 1, 1, 70, 1}, {37, 90, 5, 200, 260}, 1}, "mixed");
  test_attention<T, F8>({4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132}, "decode-split");
  test_attention<T, F8>({2, 2, 96, 1, 5, {20, 3}, {600, 530}, 132}, "prefill-split bs=1");
  test_attention<T, F8>({4, 2, 80, 8, 0, {1, 1, 1, 1}, {64, 65, 129, 1}, 132}, "decode-edges");
  test_attention<T, F8>({8, 1, 32, 16, 1, {5, 1, 17}, {300, 77, 17}, 132}, "mqa");
  test_attention<T, F8>({4, 2, 64, 16, 0, {3, 1}, {40, 300}, 132, true}, "bad block id");
  test_attention<T, F8>(windowed({4, 1, 128, 16, 0, {1, 1, 1}, {700, 1300, 40}, 132}, 600),
                        "window decode-split");
  test_attention<T, F8>({4, 2, 64, 16, 0, {3, 1, 2}, {40, 300, 2}, 132, false, true}, "corrupt");
}

// store_kv into an fp8 cache: each stored byte is the e4m3 value nearest the input (ties to
// even), checked against a search over all 256 codes; values past +-448 saturate.
template <typename T>
void test_store_kv_fp8() {
  const int Tn = 5, H = 2, D = 48, slots = 16;
  const int stride_t = (H + 1) * D;
  std::vector<T> key(static_cast<size_t>(Tn) * stride_t), value(key.size());
  for (auto& v : key) v = cast<T>(uniform(-500, 500) * (randint(0, 1) ? 1.f : 1e-3f));
  for (auto& v : value) v = cast<T>(uniform(-2, 2));
  key[3] = cast<T>(1e4f);
  std::vector<uint8_t> kc(static_cast<size_t>(slots) * H * D, 0x11), vc(kc.size(), 0x11);
  const std::vector<int64_t> slot = {3, -1, 15, 0, 99};
  const StoreKvParams p = store_kv_params(key, value, kc.data(), vc.data(), slot, slots, H, D,
                                          stride_t, 1);
  orca_emu::launch(dim3(Tn), dim3(64), 0, [&] { kvstore::store_kv_fp8_kernel<T>(p); });
  // The nearest finite code by value (ties: the even code), saturating.
  const auto nearest = [](float x) {
    int best = 0;
    double best_err = INFINITY;
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7f) == 0x7f) continue;  // NaN
      __nv_fp8_e4m3 f;
      f.__x = static_cast<__nv_fp8_storage_t>(code);
      const double err = std::abs(static_cast<double>(static_cast<float>(f)) - x);
      if (err < best_err || (err == best_err && (code & 1) == 0 && x != 0)) {
        best = code;
        best_err = err;
      }
    }
    return static_cast<uint8_t>(best);
  };
  int wrong = 0;
  for (int s = 0; s < slots; ++s) {
    int src = -1;
    for (int t = 0; t < Tn; ++t)
      if (slot[t] == s) src = t;
    for (int i = 0; i < H * D; ++i) {
      const int h = i / D, d = i % D;
      const uint8_t ek = src < 0 ? 0x11 : nearest(back(key[src * stride_t + h * D + d]));
      const uint8_t ev = src < 0 ? 0x11 : nearest(back(value[src * stride_t + D + h * D + d]));
      const uint8_t gk = kc[s * H * D + i], gv = vc[s * H * D + i];
      // +0 and -0 both round a tiny input; either is the nearest value.
      const auto same = [](uint8_t a, uint8_t b) { return a == b || ((a | b) & 0x7f) == 0; };
      wrong += !same(gk, ek) + !same(gv, ev);
    }
  }
  __nv_fp8_e4m3 saturated;
  saturated.__x = kc[3 * H * D + 3];
  report(std::string("store_kv fp8 from ") + name_of<T>(), wrong, 0,
         static_cast<float>(saturated) == 448.f);
}

// ---- packed_linear kernels -----------------------------------------------------------------------

double act_ref(double x, Act a) {
  switch (a) {
    case Act::kGeluTanh: return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case Act::kRelu: return x > 0 ? x : 0;
    default: return x;
  }
}
double silu_ref(double x) { return x / (1 + std::exp(-x)); }
// A gated act's activation of the gate.
double gate_ref(double x, Act a) {
  return a == Act::kSiluAndMul ? silu_ref(x) : act_ref(x, Act::kGeluTanh);
}

template <typename T>
void test_linear(int Tn, int N, int K, Act act, bool bias_on) {
  const bool glu = act_gated(act);
  const int Nw = glu ? 2 * N : N;
  const int ldx = K + 16 / static_cast<int>(sizeof(T));  // padded rows
  std::vector<T> x(static_cast<size_t>(Tn) * ldx), w(static_cast<size_t>(Nw) * K), b(Nw);
  for (auto& v : x) v = cast<T>(uniform(-1, 1));
  for (auto& v : w) v = cast<T>(uniform(-0.2f, 0.2f));
  for (auto& v : b) v = cast<T>(uniform(-1, 1));
  std::vector<T> out(static_cast<size_t>(Tn) * N, cast<T>(NAN));
  SkinnyLinearParams p{};
  p.x = x.data();
  p.weight = w.data();
  p.bias = bias_on ? b.data() : nullptr;
  p.out = out.data();
  p.T = Tn;
  p.N = N;
  p.K = K;
  p.x_stride = ldx;
  p.w_stride = K;
  p.act = act;
  const int cols = glu ? linear::kSkinnyRows / 2 : linear::kSkinnyRows;
  const dim3 grid((N + cols - 1) / cols);
  auto launch = [&](auto tt) {
    constexpr int TT = decltype(tt)::value;
    orca_emu::launch(grid, dim3(linear::kSkinnyThreads), 0,
                     [&] { linear::skinny_linear_kernel<T, TT>(p); });
  };
  if (Tn <= 1) launch(std::integral_constant<int, 1>{});
  else if (Tn <= 2) launch(std::integral_constant<int, 2>{});
  else if (Tn <= 4) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 8>{});
  auto dot = [&](int t, int row) {
    double s = bias_on ? back(b[row]) : 0.0;
    for (int k = 0; k < K; ++k) s += static_cast<double>(back(x[t * ldx + k])) * back(w[static_cast<size_t>(row) * K + k]);
    return s;
  };
  double err = 0;
  for (int t = 0; t < Tn; ++t)
    for (int n = 0; n < N; ++n) {
      const double ref = glu ? gate_ref(dot(t, n), act) * dot(t, N + n) : act_ref(dot(t, n), act);
      const double got = back(out[t * N + n]);
      err = std::max(err, std::isfinite(got) ? std::abs(got - ref) / (1 + std::abs(ref)) : INFINITY);
    }
  char buf[160];
  std::snprintf(buf, sizeof buf, "skinny_linear %s T=%d N=%d K=%d act=%d bias=%d", name_of<T>(), Tn,
                N, K, static_cast<int>(act), bias_on);
  report(buf, err, std::is_same_v<T, float> ? 1e-5 : 1e-2);
}

template <typename T>
void test_epilogues() {
  const int Tn = 5, I = 24;
  std::vector<T> y(Tn * 2 * I), out(Tn * I, cast<T>(NAN)), bias(2 * I);
  for (auto& v : y) v = cast<T>(uniform(-3, 3));
  for (auto& v : bias) v = cast<T>(uniform(-1, 1));
  constexpr int kVec = 16 / sizeof(T);
  double err = 0;
  for (Act act : {Act::kSiluAndMul, Act::kGeluTanhAndMul}) {
    for (int vec : {kVec, 1}) {
      std::fill(out.begin(), out.end(), cast<T>(NAN));
      orca_emu::launch(dim3(2), dim3(32), 0, [&] {
        if (vec == 1) linear::act_and_mul_kernel<T, 1>(y.data(), out.data(), Tn, I, act);
        else linear::act_and_mul_kernel<T, kVec>(y.data(), out.data(), Tn, I, act);
      });
      err = 0;
      for (int t = 0; t < Tn; ++t)
        for (int i = 0; i < I; ++i) {
          const double ref = gate_ref(back(y[t * 2 * I + i]), act) * back(y[t * 2 * I + I + i]);
          const double got = back(out[t * I + i]);
          err = std::max(err, std::isfinite(got) ? std::abs(got - ref) / (1 + std::abs(ref))
                                                 : INFINITY);
        }
      report(std::string(act == Act::kSiluAndMul ? "silu_and_mul " : "gelu_tanh_and_mul ") +
                 name_of<T>() + " vec=" + std::to_string(vec),
             err, std::is_same_v<T, float> ? 1e-5 : 1e-2);
    }
  }
  std::vector<T> z = y;
  orca_emu::launch(dim3(3), dim3(32), 0, [&] {
    linear::bias_act_kernel<T>(z.data(), bias.data(), Tn, 2 * I, Act::kGeluTanh);
  });
  err = 0;
  for (int t = 0; t < Tn; ++t)
    for (int n = 0; n < 2 * I; ++n) {
      const double ref = act_ref(static_cast<double>(back(y[t * 2 * I + n])) + back(bias[n]), Act::kGeluTanh);
      err = std::max(err, std::abs(back(z[t * 2 * I + n]) - ref) / (1 + std::abs(ref)));
    }
  report(std::string("bias_act(gelu) ") + name_of<T>(), err, std::is_same_v<T, float> ? 1e-5 : 1e-2);
}

template <typename T>
void linear_suite() {
  for (Act a : {Act::kNone, Act::kGeluTanh, Act::kRelu, Act::kSiluAndMul, Act::kGeluTanhAndMul}) {
    test_linear<T>(1, 9, 64, a, true);
    test_linear<T>(5, 6, 136, a, a != Act::kRelu);
  }
  test_linear<T>(8, 7, 512, Act::kSiluAndMul, false);
  test_linear<T>(8, 7, 512, Act::kGeluTanhAndMul, false);
  test_epilogues<T>();
}

// ---- lora_linear ---------------------------------------------------------------------------

// Segments of rows with their slots (-1: the base; an empty segment; a slot out of range is
// skipped), one CTA per row, against float64 sums.
template <typename T>
void test_lora(int K, int N, int R, const std::vector<int>& seg_lens,
               const std::vector<int>& seg_slots) {
  const int L = 3, S = static_cast<int>(seg_lens.size());
  std::vector<int32_t> cu(S + 1, 0);
  for (int s = 0; s < S; ++s) cu[s + 1] = cu[s] + seg_lens[s];
  const int Tn = cu[S];
  std::vector<T> x(static_cast<size_t>(Tn) * K), y(static_cast<size_t>(Tn) * N);
  std::vector<float> a(static_cast<size_t>(L) * R * K), b(static_cast<size_t>(L) * R * N), sc(L);
  for (auto& v : x) v = cast<T>(uniform(-1, 1));
  for (auto& v : y) v = cast<T>(uniform(-1, 1));
  for (auto& v : a) v = uniform(-0.3f, 0.3f);
  for (auto& v : b) v = uniform(-0.3f, 0.3f);
  for (auto& v : sc) v = uniform(0.5f, 2.f);
  const std::vector<T> y0 = y;
  const std::vector<int32_t> slots(seg_slots.begin(), seg_slots.end());
  LoraParams p{};
  p.y = y.data();
  p.x = x.data();
  p.lora_a = a.data();
  p.lora_b = b.data();
  p.scales = sc.data();
  p.cu_seg_lens = cu.data();
  p.seg_slots = slots.data();
  p.T = Tn;
  p.K = K;
  p.N = N;
  p.R = R;
  p.L = L;
  p.S = S;
  p.x_row_stride = K;
  orca_emu::launch(dim3(Tn), dim3(lora::kThreads), R * sizeof(float),
                   [&] { lora::lora_linear_kernel<T>(p); });
  double err = 0;
  bool base_rows_kept = true;
  for (int s = 0; s < S; ++s) {
    for (int t = cu[s]; t < cu[s + 1]; ++t) {
      const int slot = slots[s];
      for (int n = 0; n < N; ++n) {
        double ref = back(y0[static_cast<size_t>(t) * N + n]);
        if (slot >= 0 && slot < L) {
          for (int j = 0; j < R; ++j) {
            double shrink = 0;
            for (int k = 0; k < K; ++k)
              shrink += static_cast<double>(back(x[static_cast<size_t>(t) * K + k])) *
                        a[(static_cast<size_t>(slot) * R + j) * K + k];
            ref += sc[slot] * shrink * b[(static_cast<size_t>(slot) * R + j) * N + n];
          }
        } else if (std::memcmp(&y[static_cast<size_t>(t) * N + n],
                               &y0[static_cast<size_t>(t) * N + n], sizeof(T)) != 0) {
          base_rows_kept = false;
        }
        const double got = back(y[static_cast<size_t>(t) * N + n]);
        err = std::max(err, std::abs(got - ref) / (1 + std::abs(ref)));
      }
    }
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "lora_linear %s K=%d N=%d R=%d S=%d", name_of<T>(), K, N, R, S);
  report(buf, err, std::is_same_v<T, float> ? 1e-5 : 1e-2, base_rows_kept);
}

template <typename T>
void lora_suite() {
  test_lora<T>(64, 96, 8, {1}, {0});
  test_lora<T>(200, 136, 16, {3, 1, 0, 2, 4}, {1, -1, 2, 0, 7});
  test_lora<T>(33, 300, 5, {2, 6}, {-1, 2});
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  if (which == "attention" || which == "all") {
    attention_suite<__nv_bfloat16>();
    attention_suite<__half>();
    test_attention<float>({4, 2, 48, 5, 0, {6, 1}, {30, 70}, 132}, "fp32 simple");
    test_attention<__nv_bfloat16>({2, 1, 40, 4, 0, {3, 1}, {20, 50}, 132}, "odd D -> simple");
    test_attention<float>(windowed({4, 2, 48, 5, 0, {6, 1}, {30, 70}, 132}, 4),
                          "fp32 simple window");
    // Gemma 3's head dim: the simple kernel, with and without a window.
    for (int window : {0, 7}) {
      test_attention<__nv_bfloat16>(windowed({4, 2, 256, 16, 0, {5, 1}, {40, 300}, 132}, window),
                                    "D=256 -> simple");
    }
  }
  if (which == "attention_items" || which == "all") attention_many_items_suite();
  if (which == "store_kv" || which == "all") {
    for (int vb : {16, 8, 4, 2}) test_store_kv<__nv_bfloat16>(vb);
    test_store_kv<float>(16);
  }
  if (which == "fp8" || which == "all") {
    fp8_cache_suite<__nv_bfloat16>();
    fp8_cache_suite<__half>();
    test_attention<float, __nv_fp8_e4m3>({4, 2, 48, 5, 0, {6, 1}, {30, 70}, 132}, "fp32 simple");
    test_attention<__nv_bfloat16, __nv_fp8_e4m3>({2, 1, 40, 4, 0, {3, 1}, {20, 50}, 132},
                                                 "odd D -> simple");
    for (auto f : {test_store_kv_fp8<float>, test_store_kv_fp8<__half>,
                   test_store_kv_fp8<__nv_bfloat16>}) {
      f();
    }
  }
  if (which == "linear" || which == "all") {
    linear_suite<__nv_bfloat16>();
    linear_suite<__half>();
    linear_suite<float>();
  }
  if (which == "lora" || which == "all") {
    lora_suite<__nv_bfloat16>();
    lora_suite<__half>();
    lora_suite<float>();
  }
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
