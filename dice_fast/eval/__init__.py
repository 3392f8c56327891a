"""Evaluation of DICE against the single-vector baseline: the paper's retrieval tasks and diagnostics.

A consumer of the core's public API (`dice_fast.DiceEncoder`, `dice_fast.ops.aggregate_documents`,
`dice_fast.runinfo`, `dice_fast.cliargs`, `dice_fast.reuse.persistent`); it imports no sibling subpackage. One
module per step:

* `tasks`: LongEmbed-style *passkey* / *needle* tasks generated for a tokenizer, and local BEIR
  folders (`Task`, `make_passkey_task`, `make_needle_task`, `load_local_task`); `_haystack` cuts the
  documents from a tokenized filler / prose source.
* `retrieval`: exact cosine top-k search within groups, Hit@k, nDCG@k (trec_eval's ``ndcg_cut``), `evaluate`.
* `diagnostics`: the paper's Evidence Concentration and Evidence Dilution Index (`evidence_stats`).
* `run`: the eval run (`run_eval` -> `EvalResult`): each chunk size encoded once with
  ``return_chunks=True``, every aggregation derived from those chunks (`aggregate_from_chunks`,
  `raw_twin`), queries encoded once; `build_task` turns "passkey" / "needle" / a folder into a task.
* `report`: paper-style markdown tables (≤4k / >4k macro averages, then each length), the markdown
  report, CSV rows appended with `dice_fast.runinfo.append_csv`.
* `plots`: Hit@1 vs context length and EDI box plots (matplotlib, imported on first use).
* `cli`: the ``dice-fast eval`` sub-command (`register_cli(subparsers)`, `cmd_eval`, `write_outputs`).

    from dice_fast import DiceEncoder
    from dice_fast.eval.tasks import make_passkey_task
    from dice_fast.eval.run import run_eval
    from dice_fast.eval.report import format_report

    enc = DiceEncoder.from_pretrained()
    task = make_passkey_task(enc.tokenizer, lengths=(256, 1024, 8192), docs_per_length=20, queries_per_length=10)
    print(format_report(run_eval(task, enc, chunk_sizes=(64, 254))))

Importing this package imports nothing else; each module loads what it needs.
"""
