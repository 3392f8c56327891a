"""The pooling ops' names and the checks of their options, without torch: the settings and the
command line import them (``dice-fast --help`` loads no torch); `dice_fast.ops.spec` defines what
each name computes."""

from __future__ import annotations

from ..errors import OptionError

POOLINGS = ("mean", "cls", "last")
AGGREGATIONS = ("mean", "weighted_mean", "max", "topk_norm", "softmax_norm")
NORM_EPS = 1e-12

# The one argument list of each op (names, types, order, defaults), in torch.library schema syntax.
SCHEMAS = {
    "pool_chunks": '(Tensor hidden, Tensor cu_seqlens, str pooling="mean") -> Tensor',
    "aggregate_documents": (
        '(Tensor chunks, Tensor cu_doc_chunks, Tensor? chunk_weights=None, str aggregation="mean", '
        "int top_k=1, float temperature=1.0, bool normalize_chunks=False, bool normalize=True) -> Tensor"
    ),
}


def check_pooling(pooling: str) -> int:
    """Return the integer code of ``pooling`` (its index in `POOLINGS`) or raise ValueError."""
    if pooling not in POOLINGS:
        raise OptionError(f"unknown pooling {pooling!r}; allowed: {', '.join(POOLINGS)}")
    return POOLINGS.index(pooling)


MIN_TEMPERATURE = 1e-30  # softmax_norm: a chunk norm / temperature stays finite even in float32 (norms < 3e8)


def check_aggregation(aggregation: str, top_k: int = 1, temperature: float = 1.0) -> int:
    """Return the integer code of ``aggregation`` (its index in `AGGREGATIONS`) or raise ValueError."""
    if aggregation not in AGGREGATIONS:
        raise OptionError(f"unknown aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}")
    if aggregation == "topk_norm" and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise OptionError(f"top_k must be an integer >= 1 for aggregation='topk_norm', got {top_k!r}")
    if aggregation == "softmax_norm":
        t = float(temperature) if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) else -1.0
        if not (t >= MIN_TEMPERATURE and t < float("inf")):  # below it, norm / t overflows to inf: NaN weights
            raise OptionError(f"temperature must be a finite number >= {MIN_TEMPERATURE:g} for "
                              f"aggregation='softmax_norm', got {temperature!r}")
    return AGGREGATIONS.index(aggregation)
