// Operator schemas of the dice_fast_C library, and their Meta (shape-only) kernels.
//
// The CPU kernels live in segment_pool_cpu.cpp and the CUDA kernels in segment_pool_cuda.cu (compiled
// only when the extension is built with CUDA); each registers itself with TORCH_LIBRARY_IMPL.
// The Meta kernels let torch.compile / FakeTensor trace through the ops without running them.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "segment_pool.h"

namespace dice_fast {
namespace {

at::Tensor pool_chunks_meta(const at::Tensor& hidden, const at::Tensor& cu_seqlens, c10::string_view pooling) {
  check_pool_chunks_args(hidden, cu_seqlens, pooling);
  return at::empty({cu_seqlens.size(0) - 1, hidden.size(1)}, hidden.options().dtype(at::kFloat));
}

at::Tensor aggregate_documents_meta(const at::Tensor& chunks, const at::Tensor& cu_doc_chunks,
                                    const std::optional<at::Tensor>& chunk_weights, c10::string_view aggregation,
                                    int64_t top_k, double temperature, bool /*normalize_chunks*/, bool /*normalize*/) {
  check_aggregate_args(chunks, cu_doc_chunks, chunk_weights, aggregation, top_k, temperature);
  return at::empty({cu_doc_chunks.size(0) - 1, chunks.size(1)}, chunks.options());
}

}  // namespace
}  // namespace dice_fast

// The schemas are those of SCHEMAS in dice_fast/ops/spec.py, character for character (the one
// argument list of each op; tests/ops/test_dispatch.py compares this file and the loaded ops with it).
TORCH_LIBRARY(dice_fast_C, m) {
  m.def(R"(pool_chunks(Tensor hidden, Tensor cu_seqlens, str pooling="mean") -> Tensor)");
  m.def(
      R"(aggregate_documents(Tensor chunks, Tensor cu_doc_chunks, Tensor? chunk_weights=None, str aggregation="mean", )"
      R"(int top_k=1, float temperature=1.0, bool normalize_chunks=False, bool normalize=True) -> Tensor)");
}

TORCH_LIBRARY_IMPL(dice_fast_C, Meta, m) {
  m.impl("pool_chunks", &dice_fast::pool_chunks_meta);
  m.impl("aggregate_documents", &dice_fast::aggregate_documents_meta);
}
