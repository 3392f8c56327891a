"""The server's limits: names, defaults and meanings in one place, for `AsyncDiceEncoder`, the
``dice-fast serve`` flags and the README table. Imports nothing heavy (the CLI registers from it)."""

from __future__ import annotations

# name -> (default, meaning); the flag is --name-with-dashes
LIMITS = {
    "max_inputs_per_request": (2048, "inputs in one request (OpenAI's own limit); more: 413"),
    "max_tokens_per_document": (0, "tokens of one input, special tokens included, 0 = unlimited; "
                                   "more: 413 naming the input"),
    "max_queue_tokens": (None, "tokens waiting to run, all requests together (default 64 x max_batch_tokens); "
                               "a request that would pass it: 429 + Retry-After; one larger than it: 413"),
    "max_concurrent_requests": (512, "requests in progress at once (TEI's default); one more: 429 + Retry-After"),
}
DEFAULT_LIMITS = {name: default for name, (default, _) in LIMITS.items()}
QUEUE_BATCHES = 64  # the default max_queue_tokens, in batches of max_batch_tokens
DEFAULT_CACHE_MEMORY_MB = 64  # chunk vectors kept in memory across requests (about 40k 384-d chunks)
