"""The server benchmark: closed-loop clients at 1, 8 and 64 concurrency against `dice-fast serve`
(cross-request batching on and off), compared with offline `encode_documents` on the same corpus.

    python benchmarks/bench_serve.py                       # = dice-fast bench-serve (defaults)
    python benchmarks/bench_serve.py --docs 32 --concurrency 1,4 --max-tokens 512   # a quick check

All arguments are those of `dice-fast bench-serve --help`; the code is `dice_fast/serve/bench.py`.
"""

import sys

from dice_fast.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serve", *sys.argv[1:]]))
