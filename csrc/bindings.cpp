// Python module orca_ext._C: loading it registers torch.ops.orca (registration.cpp and the
// kernels' TORCH_LIBRARY_IMPL blocks); it also binds the KV slot allocator, the greedy
// sampler's row-wise argmax and the GGUF vocabulary's readers (text/gguf_vocab.h).
#include <ATen/Parallel.h>
#include <pybind11/numpy.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/isa_choice.h"
#include "kv/metadata.h"
#include "kv/slot_allocator.h"
#include "text/gguf_vocab.h"
#if ORCA_EXT_HAS_CUDA
#include "cuda/test_limits.h"
#endif

namespace py = pybind11;
using orca::kv::SlotAllocator;

namespace {

// (cu_q_lens, context_lens, block_table, slot_mapping, positions) CPU tensors for one iteration.
py::tuple build_metadata(const std::vector<std::vector<int32_t>>& block_ids,
                         const std::vector<int64_t>& num_computed,
                         const std::vector<int64_t>& num_new, int64_t block_size) {
  if (num_computed.size() != block_ids.size() || num_new.size() != block_ids.size()) {
    throw std::invalid_argument("build_metadata: block_ids, num_computed and num_new must have "
                                "the same length, got " + std::to_string(block_ids.size()) +
                                ", " + std::to_string(num_computed.size()) + ", " +
                                std::to_string(num_new.size()));
  }
  const auto shape =
      orca::kv::metadata_shape(block_ids, num_computed.data(), num_new.data(), block_size);
  const auto i32 = torch::dtype(torch::kInt32);
  const auto i64 = torch::dtype(torch::kInt64);
  const int64_t batch = shape.batch;
  auto cu_q_lens = torch::empty({batch + 1}, i32);
  auto context_lens = torch::empty({batch}, i32);
  auto block_table = torch::empty({batch, shape.max_blocks}, i32);
  auto slot_mapping = torch::empty({shape.num_tokens}, i64);
  auto positions = torch::empty({shape.num_tokens}, i64);
  orca::kv::fill_metadata(block_ids, num_computed.data(), num_new.data(), block_size, shape,
                          cu_q_lens.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                          block_table.data_ptr<int32_t>(), slot_mapping.data_ptr<int64_t>(),
                          positions.data_ptr<int64_t>());
  return py::make_tuple(cu_q_lens, context_lens, block_table, slot_mapping, positions);
}

// build_metadata for requests as the allocator holds them.
py::tuple allocator_metadata(const SlotAllocator& alloc, const std::vector<int64_t>& request_ids,
                             const std::vector<int64_t>& num_computed,
                             const std::vector<int64_t>& num_new) {
  if (num_computed.size() == request_ids.size() && num_new.size() == request_ids.size()) {
    alloc.check_rows(request_ids.data(), num_computed.data(), num_new.data(),
                     static_cast<int64_t>(request_ids.size()));
  }
  std::vector<std::vector<int32_t>> block_ids;
  block_ids.reserve(request_ids.size());
  for (const int64_t id : request_ids) block_ids.push_back(alloc.blocks(id));
  return build_metadata(block_ids, num_computed, num_new, alloc.block_size());
}

// A call into the ops' C++ with its TORCH_CHECK failures raised as ValueError (a bad argument).
template <typename F>
auto value_errors(const F& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw py::value_error(e.what_without_backtrace());
  }
}

// The first maximum of p[0, n) (a NaN counts as the maximum, its first one wins), as
// torch.argmax finds it: running maxima over 16 lanes and a NaN flag (SSE2, x86-64's baseline:
// maxps(v, m) is exactly v > m ? v : m), then the first element equal to the maximum.
int64_t first_argmax(const float* p, int64_t n) {
  float lane_max[16];
  std::fill_n(lane_max, 16, -std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t j = 0;
#if defined(__SSE2__)
  __m128 m[4], unordered = _mm_setzero_ps();
  for (auto& v : m) v = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 16 <= n; j += 16) {
    for (int l = 0; l < 4; ++l) {
      const __m128 v = _mm_loadu_ps(p + j + 4 * l);
      unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
      m[l] = _mm_max_ps(v, m[l]);
    }
  }
  for (int l = 0; l < 4; ++l) _mm_storeu_ps(lane_max + 4 * l, m[l]);
  nan = _mm_movemask_ps(unordered) != 0;
#endif
  for (; j < n; ++j) {
    nan |= std::isnan(p[j]);
    lane_max[0] = p[j] > lane_max[0] ? p[j] : lane_max[0];
  }
  if (nan) return std::find_if(p, p + n, [](float v) { return std::isnan(v); }) - p;
  const float best = *std::max_element(lane_max, lane_max + 16);
  return std::find(p, p + n, best) - p;
}

// Each row's argmax of float32 logits [rows, vocab] on the CPU, as torch.argmax gives it. For
// greedy decoding: at a few rows torch.argmax + tolist costs mostly the set-up of the
// reduction, on caches the step's weight stream has evicted, and this has none; the rows of a
// batch split across the threads (a 32-row batch of Gemma 3's 262,144 logits is 34 MB).
std::vector<int64_t> argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() &&
                  logits.scalar_type() == at::kFloat,
              "argmax_rows: expected float32 CPU logits [rows, vocab], got ",
              logits.scalar_type(), " on ", logits.device(), " with shape ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: logits have no columns (shape ", logits.sizes(),
              ")");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  const float* p = x.data_ptr<float>();
  std::vector<int64_t> out(rows);
  constexpr int64_t kMinParallelLogits = 1 << 16;
  at::parallel_for(0, rows, (kMinParallelLogits + vocab - 1) / vocab,
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = first_argmax(p + r * vocab, vocab);
  });
  return out;
}

// (strings, bounds [count, 2] int64): the GGUF string array of `count` strings at byte `offset`
// of `data` (a 1-D buffer of bytes), decoded as UTF-8, and where each one's bytes lie.
py::tuple gguf_string_array(const py::buffer& data, int64_t offset, int64_t count, bool swap) {
  const py::buffer_info info = data.request();
  if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1) {
    throw py::value_error("gguf_string_array: data must be a contiguous 1-D buffer of bytes");
  }
  const auto* bytes = static_cast<const uint8_t*>(info.ptr);
  std::vector<orca::text::StringBounds> bounds;
  try {
    bounds = orca::text::gguf_string_bounds(bytes, info.shape[0], offset, count, swap);
  } catch (const std::out_of_range& e) {
    throw py::value_error(e.what());
  }
  py::list strings(bounds.size());
  py::array_t<int64_t> where({static_cast<py::ssize_t>(bounds.size()), py::ssize_t{2}});
  auto out = where.mutable_unchecked<2>();
  for (size_t i = 0; i < bounds.size(); ++i) {
    const auto [begin, end] = bounds[i];
    PyObject* text = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(bytes + begin),
                                          end - begin, "strict");
    if (text == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(strings.ptr(), i, text);
    out(i, 0) = begin;
    out(i, 1) = end;
  }
  return py::make_tuple(strings, where);
}

// sentencepiece_merges of Python strings: (left, right) pairs of the tokens' own str objects.
py::list sentencepiece_merges(const py::list& tokens, const std::vector<double>& scores) {
  std::vector<std::string_view> views(tokens.size());
  for (size_t i = 0; i < views.size(); ++i) {
    PyObject* token = PyList_GET_ITEM(tokens.ptr(), i);
    if (!PyUnicode_Check(token)) {
      throw py::type_error("sentencepiece_merges: token " + std::to_string(i) +
                           " is not a str");
    }
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(token, &size);
    if (utf8 == nullptr) throw py::error_already_set();
    views[i] = {utf8, static_cast<size_t>(size)};
  }
  for (size_t i = 0; i < scores.size(); ++i) {
    if (std::isnan(scores[i])) {
      throw py::value_error("sentencepiece_merges: the score of token " + std::to_string(i) +
                            " is NaN");
    }
  }
  std::vector<orca::text::Merge> merges;
  try {
    // Without the GIL: the views point into str objects the list holds, and a str never
    // changes.
    py::gil_scoped_release no_gil;
    merges = orca::text::sentencepiece_merges(views, scores);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  py::list pairs(merges.size());
  for (size_t k = 0; k < merges.size(); ++k) {
    PyObject* pair = PyTuple_Pack(2, PyList_GET_ITEM(tokens.ptr(), merges[k].left),
                                  PyList_GET_ITEM(tokens.ptr(), merges[k].right));
    if (pair == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(pairs.ptr(), k, pair);
  }
  return pairs;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "orca_ext compiled core: torch.ops.orca kernels and the KV slot allocator";
  m.def("has_cuda", [] { return static_cast<bool>(ORCA_EXT_HAS_CUDA); },
        "Whether this build contains the CUDA kernels");

  py::register_exception<orca::kv::KVCacheFullError>(m, "KVCacheFullError", PyExc_RuntimeError);
  py::register_exception<orca::kv::UnknownRequestError>(m, "UnknownRequestError", PyExc_KeyError);

  py::class_<SlotAllocator>(m, "SlotAllocator",
                            "Fixed pool of num_blocks x block_size KV slots with per-request "
                            "block lists (see docs/internals.md)")
      .def(py::init<int64_t, int64_t>(), py::arg("num_blocks"), py::arg("block_size"))
      .def("allocate", &SlotAllocator::allocate, py::arg("request_id"), py::arg("num_tokens"),
           py::arg("prefix_hashes") = std::vector<uint64_t>{},
           "Give a new request blocks for num_tokens slots, reusing the cached blocks of the "
           "longest found prefix of prefix_hashes; returns the cached tokens reused")
      .def("extend", &SlotAllocator::extend, py::arg("request_id"), py::arg("total_tokens"),
           "Grow a request's blocks to hold total_tokens slots")
      .def("free", &SlotAllocator::free, py::arg("request_id"),
           "Drop a request's blocks: hashed ones stay cached (evictable), others become free")
      .def("can_allocate", &SlotAllocator::can_allocate, py::arg("num_tokens"),
           py::arg("prefix_hashes") = std::vector<uint64_t>{})
      .def("num_blocks_to_allocate", &SlotAllocator::num_blocks_to_allocate,
           py::arg("num_tokens"), py::arg("prefix_hashes") = std::vector<uint64_t>{},
           "How much num_free_blocks would drop on allocate(num_tokens, prefix_hashes)")
      .def("blocks_needed", &SlotAllocator::blocks_needed, py::arg("num_tokens"))
      .def("capacity", &SlotAllocator::capacity, py::arg("request_id"))
      .def("blocks", &SlotAllocator::blocks, py::arg("request_id"))
      .def("__contains__", &SlotAllocator::contains)
      .def("block_hashes", &SlotAllocator::block_hashes, py::arg("token_ids"),
           py::arg("extra_key") = 0, py::arg("parent") = py::none(),
           "64-bit hashes of the full blocks of token_ids, each chained on the previous one "
           "(the first on parent) and salted with extra_key")
      .def("num_cached_prefix_blocks", &SlotAllocator::num_cached_prefix_blocks,
           py::arg("hashes"), "Length of the longest prefix of hashes that is cached")
      .def("cache_blocks", &SlotAllocator::cache_blocks, py::arg("request_id"),
           py::arg("hashes"),
           "Register hashes[i] for the request's computed block i; returns how many were new")
      .def("shared_prefix_blocks", &SlotAllocator::shared_prefix_blocks, py::arg("request_id"),
           "Leading hashed (read-only, maybe shared) blocks of the request's list")
      .def("reset_prefix_cache", &SlotAllocator::reset_prefix_cache,
           "Forget the hashes of all evictable blocks; returns how many")
      .def("ref_count", &SlotAllocator::ref_count, py::arg("block"))
      .def("check_invariants", &SlotAllocator::check_invariants,
           "Raise RuntimeError naming the first broken bookkeeping invariant")
      .def(
          "check_rows",
          [](const SlotAllocator& alloc, const std::vector<int64_t>& request_ids,
             const std::vector<int64_t>& num_computed, const std::vector<int64_t>& num_new) {
            if (num_computed.size() != request_ids.size() ||
                num_new.size() != request_ids.size()) {
              throw std::invalid_argument("check_rows: request_ids, num_computed and num_new "
                                          "must have the same length");
            }
            alloc.check_rows(request_ids.data(), num_computed.data(), num_new.data(),
                             static_cast<int64_t>(request_ids.size()));
          },
          py::arg("request_ids"), py::arg("num_computed"), py::arg("num_new"),
          "ValueError unless every row's new tokens fit its request's blocks and none lands "
          "in a cached (read-only, maybe shared) block")
      .def_property_readonly("num_blocks", &SlotAllocator::num_blocks)
      .def_property_readonly("block_size", &SlotAllocator::block_size)
      .def_property_readonly("num_free_blocks", &SlotAllocator::num_free_blocks)
      .def_property_readonly("num_used_blocks", &SlotAllocator::num_used_blocks)
      .def_property_readonly("num_requests", &SlotAllocator::num_requests)
      .def_property_readonly("num_cached_blocks", &SlotAllocator::num_cached_blocks)
      .def_property_readonly("num_evictable_blocks", &SlotAllocator::num_evictable_blocks)
      .def("build_metadata", &allocator_metadata, py::arg("request_ids"),
           py::arg("num_computed"), py::arg("num_new"),
           "(cu_q_lens, context_lens, block_table, slot_mapping, positions) for one iteration");
  m.def("build_metadata", &build_metadata, py::arg("block_ids"), py::arg("num_computed"),
        py::arg("num_new"), py::arg("block_size"),
        "(cu_q_lens, context_lens, block_table, slot_mapping, positions) for one iteration, "
        "from each request's block ids");
  m.def("quant_isas", [] { return orca::isa_names("quant"); },
        "The paths of quantized_linear's kernels this CPU runs, by their ORCA_QUANT_ISA names");
  m.def("attention_isas", [] { return orca::isa_names("attention"); },
        "The paths of ragged_attention's prefill-like bfloat16 kernels this build and CPU run, "
        "by their ORCA_ATTENTION_ISA names");
  m.def("lora_isas", [] { return orca::isa_names("lora"); },
        "The paths of lora_linear's kernels this CPU runs, by their ORCA_LORA_ISA names");
  m.def("set_isa", [](const std::string& kind, const std::string& name) {
        value_errors([&] { orca::set_isa(kind, name); });
      }, py::arg("kind"), py::arg("name"),
      "Run the kernels of kind 'quant', 'attention' or 'lora' on path `name` (one of "
      "quant_isas() / attention_isas() / lora_isas()) from now on, in this process; '' goes "
      "back to the default (the ORCA_*_ISA variable read at load, else the best path)");
  m.def("get_isa", [](const std::string& kind) {
        return value_errors([&] { return orca::get_isa(kind); });
      }, py::arg("kind"), "The path the kernels of kind 'quant', 'attention' or 'lora' run now");
#if ORCA_EXT_HAS_CUDA
  m.def("_set_cuda_test_limits", [](int64_t attn_max_ctas, int64_t attn_max_splits,
                                    bool linear_no_epilogue) {
        if (attn_max_ctas < 0 || attn_max_splits < 0 || attn_max_splits > INT32_MAX) {
          throw py::value_error("attn_max_ctas and attn_max_splits must be non-negative "
                                "(0: no cap), got " + std::to_string(attn_max_ctas) + " and " +
                                std::to_string(attn_max_splits));
        }
        auto& limits = orca::cuda::test_limits();
        limits.attn_max_ctas = attn_max_ctas;
        limits.attn_max_splits = attn_max_splits;
        limits.linear_no_epilogue = linear_no_epilogue;
      }, py::arg("attn_max_ctas") = 0, py::arg("attn_max_splits") = 0,
      py::arg("linear_no_epilogue") = false,
      "Tests only: cap the CUDA attention's grid and KV splits, run packed_linear without "
      "cuBLASLt's epilogue (all off by default; orca_ext.testing.cuda_test_limits)");
#endif
  m.def("gguf_string_array", &gguf_string_array, py::arg("data"), py::arg("offset"),
        py::arg("count"), py::arg("swap"),
        "(strings, bounds): a GGUF string array of `count` strings at byte `offset` of `data` "
        "(a bytes buffer; `swap`: its counts are not in the machine's byte order), decoded as "
        "UTF-8, and each one's [begin, end) bytes as an int64 array [count, 2]");
  m.def("sentencepiece_merges", &sentencepiece_merges, py::arg("tokens"), py::arg("scores"),
        "SentencePiece BPE's merges implied by a vocabulary (a list of str, one score each), "
        "as (left, right) pairs of its tokens, in transformers' order");
  m.def("argmax_rows", &argmax_rows, py::arg("logits"),
        "Each row's argmax of float32 CPU logits [rows, vocab] (as torch.argmax), as a list");
}
