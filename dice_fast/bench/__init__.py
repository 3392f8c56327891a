"""Benchmarking: the packed engine against naive chunk batching, on the same model, dtype and corpus.

A consumer of the core's public API only (`dice_fast.DiceEncoder`, `EncodingPlan`, `dice_fast.ops`,
`dice_fast.runinfo`, `dice_fast.cliargs`, `dice_fast.data`); it imports no sibling subpackage.

* `dice_fast.bench.corpora`   corpus lengths, the prose corpus, a word tokenizer, random-weight models
* `dice_fast.bench.baselines` the naive paths: padded_sorted, padded_naive, sentence-transformers
* `dice_fast.bench.measure`   peak memory, model FLOPs, the matmul rate, the interleaved timing loop
* `dice_fast.bench.run`       `benchmark()` -> `Row`s, the CSV, the table
* `dice_fast.bench.cli`       ``register_cli(subparsers)``: the ``dice-fast bench`` subcommand

Importing this package imports nothing else; the modules load torch and transformers when used.
"""
