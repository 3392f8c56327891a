// Segment pooling (DICE): token states -> chunk vectors -> document vectors.
//
// Shared host-side declarations of the C++ twins of dice_fast/ops/spec.py (the spec and its
// float64 references). Included by the CPU (.cpp) and CUDA (.cu) translation units, so it uses
// only host headers that every torch wheel ships.
//
// Layouts (see the Python spec):
//   hidden        (total_tokens, hidden_size)   float32 / bfloat16 / float16, rows contiguous
//   cu_seqlens    (n_chunks + 1,)               int32, [0] == 0, non-decreasing
//   chunks        (n_chunks, hidden_size)       float32
//   cu_doc_chunks (n_docs + 1,)                 int64, [0] == 0, non-decreasing
//   chunk_weights (n_chunks,)                   float32 (weighted_mean only)
// Outputs are float32. Accumulation is float32 everywhere (the CPU twin also reduces norms in
// double at the end). An empty chunk or document (outside the contract) yields a zero vector.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace dice_fast {

// Codes follow the order of POOLINGS / AGGREGATIONS in dice_fast/ops/spec.py.
enum class Pooling : int { kMean = 0, kCls = 1, kLast = 2 };
enum class Aggregation : int { kMean = 0, kWeightedMean = 1, kMax = 2, kTopkNorm = 3, kSoftmaxNorm = 4 };

// L2 normalisation divides by max(norm, kNormEps), like torch.nn.functional.normalize.
constexpr double kNormEps = 1e-12;

inline Pooling parse_pooling(c10::string_view s) {
  if (s == "mean") return Pooling::kMean;
  if (s == "cls") return Pooling::kCls;
  if (s == "last") return Pooling::kLast;
  TORCH_CHECK_VALUE(false, "dice_fast_C: unknown pooling '", std::string(s), "'; allowed: mean, cls, last");
}

inline Aggregation parse_aggregation(c10::string_view s) {
  if (s == "mean") return Aggregation::kMean;
  if (s == "weighted_mean") return Aggregation::kWeightedMean;
  if (s == "max") return Aggregation::kMax;
  if (s == "topk_norm") return Aggregation::kTopkNorm;
  if (s == "softmax_norm") return Aggregation::kSoftmaxNorm;
  TORCH_CHECK_VALUE(false, "dice_fast_C: unknown aggregation '", std::string(s),
                    "'; allowed: mean, weighted_mean, max, topk_norm, softmax_norm");
}

// Metadata checks shared by both devices (no device synchronisation). Returns the pooling code.
inline Pooling check_pool_chunks_args(const at::Tensor& hidden, const at::Tensor& cu_seqlens,
                                      c10::string_view pooling) {
  const Pooling p = parse_pooling(pooling);
  TORCH_CHECK(hidden.dim() == 2, "dice_fast_C::pool_chunks: hidden must be 2-D (total_tokens, hidden_size), got ",
              hidden.dim(), "-D of shape ", hidden.sizes());
  const auto dt = hidden.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "dice_fast_C::pool_chunks: hidden must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "dice_fast_C::pool_chunks: cu_seqlens must be 1-D (n_chunks + 1,), got shape ", cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt, "dice_fast_C::pool_chunks: cu_seqlens must be int32, got ",
              cu_seqlens.scalar_type());
  TORCH_CHECK(cu_seqlens.device() == hidden.device(), "dice_fast_C::pool_chunks: cu_seqlens is on ",
              cu_seqlens.device(), " but hidden is on ", hidden.device());
  TORCH_CHECK(hidden.size(0) <= INT32_MAX, "dice_fast_C::pool_chunks: at most 2^31 - 1 tokens per call (int32 cu_seqlens)");
  return p;
}

// Returns the aggregation code.
inline Aggregation check_aggregate_args(const at::Tensor& chunks, const at::Tensor& cu_doc_chunks,
                                        const std::optional<at::Tensor>& chunk_weights, c10::string_view aggregation,
                                        int64_t top_k, double temperature) {
  const Aggregation a = parse_aggregation(aggregation);
  TORCH_CHECK(chunks.dim() == 2, "dice_fast_C::aggregate_documents: chunks must be 2-D (n_chunks, hidden_size), got ",
              chunks.dim(), "-D of shape ", chunks.sizes());
  TORCH_CHECK(chunks.scalar_type() == at::kFloat, "dice_fast_C::aggregate_documents: chunks must be float32, got ",
              chunks.scalar_type());
  TORCH_CHECK(cu_doc_chunks.dim() == 1 && cu_doc_chunks.numel() >= 1,
              "dice_fast_C::aggregate_documents: cu_doc_chunks must be 1-D (n_docs + 1,), got shape ",
              cu_doc_chunks.sizes());
  TORCH_CHECK(cu_doc_chunks.scalar_type() == at::kLong,
              "dice_fast_C::aggregate_documents: cu_doc_chunks must be int64, got ", cu_doc_chunks.scalar_type());
  TORCH_CHECK(cu_doc_chunks.device() == chunks.device(), "dice_fast_C::aggregate_documents: cu_doc_chunks is on ",
              cu_doc_chunks.device(), " but chunks is on ", chunks.device());
  if (a == Aggregation::kWeightedMean) {
    TORCH_CHECK(chunk_weights.has_value(),
                "dice_fast_C::aggregate_documents: aggregation='weighted_mean' needs chunk_weights (n_chunks,) float32");
    const at::Tensor& w = *chunk_weights;
    TORCH_CHECK(w.dim() == 1 && w.size(0) == chunks.size(0) && w.scalar_type() == at::kFloat,
                "dice_fast_C::aggregate_documents: chunk_weights must be float32 of shape (", chunks.size(0),
                ",), got shape ", w.sizes(), " and dtype ", w.scalar_type());
    TORCH_CHECK(w.device() == chunks.device(), "dice_fast_C::aggregate_documents: chunk_weights is on ", w.device(),
                " but chunks is on ", chunks.device());
  }
  if (a == Aggregation::kTopkNorm) {
    TORCH_CHECK_VALUE(top_k >= 1, "dice_fast_C::aggregate_documents: top_k must be >= 1 for aggregation='topk_norm', got ",
                      top_k);
  }
  if (a == Aggregation::kSoftmaxNorm) {
    TORCH_CHECK_VALUE(temperature > 0.0 && temperature < std::numeric_limits<double>::infinity(),
                      "dice_fast_C::aggregate_documents: temperature must be a finite number > 0 for "
                      "aggregation='softmax_norm', got ", temperature);
  }
  return a;
}

}  // namespace dice_fast
