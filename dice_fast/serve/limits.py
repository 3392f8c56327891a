"""The server's limits: names, defaults and meanings in one place, for `AsyncDiceEncoder`, `create_app`,
the ``dice-fast serve`` flags and the README table. Imports nothing heavy (the CLI registers from it)."""

from __future__ import annotations

import math

from ..config import checked_integer

# name -> (default, meaning); the flag is --name-with-dashes. The batching core's limits:
LIMITS = {
    "max_inputs_per_request": (2048, "inputs in one request (OpenAI's own limit); more: 413"),
    "max_input_chars": (None, "characters of one input, checked before tokenizing (default 8 per token of the "
                              "tightest token limit: max_tokens_per_document, else max_queue_tokens); more: "
                              "413 naming the input"),
    "max_tokens_per_document": (0, "tokens of one input, special tokens included, 0 = unlimited; "
                                   "more: 413 naming the input"),
    "max_queue_tokens": (None, "tokens waiting to run, all requests together (default 64 x max_batch_tokens); "
                               "a request that would pass it: 429 + Retry-After; one larger than it: 413"),
    "max_concurrent_requests": (512, "requests in progress at once (TEI's default); one more: 429 + Retry-After"),
    "max_response_floats": (1 << 21, "floats in one response: width x (inputs + chunks with return_chunks), "
                                     "width being 'dimensions' or the model's (evidence: 6 numbers per document); "
                                     "more: 413 naming the sizes, before the forward (8 MiB of float32: ~40 MB as "
                                     "float JSON, 11 MB as base64)"),
    "request_timeout": (120.0, "seconds a request may take from arrival to its vectors, 0 = none; past it: "
                               "504 and its chunks that have not run are dropped"),
}
DEFAULT_LIMITS = {name: default for name, (default, _) in LIMITS.items()}
QUEUE_BATCHES = 64  # the default max_queue_tokens, in batches of max_batch_tokens
# Default byte and character limits, per token of the token limit they guard: English runs ~4.5
# characters per token; 8 leaves room for code, markup, JSON escapes and multi-byte UTF-8, so a text
# that could ever fit passes, and one that cannot is refused before it costs a tokenizer call.
# With the CPU defaults (max_queue_tokens 262,144) both are 2 MiB, TEI's --payload-limit.
CHARS_PER_TOKEN = 8
BYTES_PER_TOKEN = 8

# The HTTP app's own limit (`create_app`): the body is counted while it streams in.
HTTP_LIMITS = {
    "max_body_bytes": (None, f"bytes of a request body, counted as it arrives (default {BYTES_PER_TOKEN} per token "
                             "of max_queue_tokens: 2 MiB on the CPU defaults); more: 413 before it is read whole"),
}


def default_max_input_chars(max_tokens_per_document: int, max_queue_tokens: int) -> int:
    """The default ``max_input_chars``: `CHARS_PER_TOKEN` per token of the tightest token limit."""
    return CHARS_PER_TOKEN * min(max_tokens_per_document or max_queue_tokens, max_queue_tokens)


def default_max_body_bytes(max_queue_tokens: int) -> int:
    """The default ``max_body_bytes``: `BYTES_PER_TOKEN` per token the queue holds."""
    return BYTES_PER_TOKEN * max_queue_tokens


DEFAULT_CACHE_MEMORY_MB = 64  # chunk vectors kept in memory across requests (about 40k 384-d chunks)

# the lowest value of each integer limit (None: its default); request_timeout and read_timeout are seconds
_LOWEST = {"max_inputs_per_request": 1, "max_input_chars": 1, "max_tokens_per_document": 0, "max_queue_tokens": 1,
           "max_concurrent_requests": 1, "max_response_floats": 1, "max_batch_tokens": 1, "cache_memory_mb": 0,
           "max_body_bytes": 1}


def check_limits(**values) -> dict:
    """`ValueError` naming the first limit out of range, before anything is built: the `LIMITS`, the
    `HTTP_LIMITS`, ``max_batch_tokens``, ``cache_memory_mb`` and ``read_timeout`` (the body's, > 0 or None).
    Returns ``values`` with each count a plain int (a numpy integer is the int it holds)."""
    values = dict(values)
    for name, value in values.items():
        if name == "request_timeout":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"request_timeout must be a number of seconds >= 0 (0 = none), got {value!r}")
        elif name == "read_timeout":
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"read_timeout must be a number of seconds > 0 (or None), got {value!r}")
        elif name not in _LOWEST:
            raise TypeError(f"unknown server limit {name!r}")
        else:
            values[name] = checked_integer(name, value, _LOWEST[name], optional=True)
    return values
