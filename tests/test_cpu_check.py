"""benchmarks/cpu_check.py's verdict: issue 25's targets judged from a run's CSV rows (the measuring
steps run only on a quiet machine, never in the suite), and bench_peers.py's per-round column read back."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import cpu_check  # noqa: E402


def _peer(path, tps, cos_min, each=""):
    return {"path": path, "tokens_per_s": str(tps), "cos_min": str(cos_min), "tokens_per_s_each": each}


PEERS = [_peer("st_torch_fp32", 5000, 1.0), _peer("st_openvino_int8_static", 20000, 0.9925, "19000/21000"),
         _peer("st_openvino", 15000, 0.99997)]
MIXED = [{"path": "dice_fast", "dtype": "float32", "tokens_per_s": "5000"},
         {"path": "dice_fast", "dtype": "bfloat16", "tokens_per_s": "12000"},
         {"path": "padded_sorted", "dtype": "bfloat16", "tokens_per_s": "99999"}]


def test_best_path_is_the_fastest_at_the_peers_agreement():
    ours = [_peer("dice_fp32", 6000, 1.0), _peer("dice_compiled", 6300, 1.0),
            _peer("dice_int8", 40000, 0.99),  # faster, but below the peer's cos min: not the best path
            _peer("dice_bf16", 25000, 0.9999, "24000/26000")]
    lines = cpu_check.verdict(PEERS + ours, MIXED)
    best = next(line for line in lines if line.startswith("best path"))
    assert "dice_bf16" in best and "st_openvino_int8_static" in best and "1.250x" in best and "target 1.2x: met" in best
    assert "per round 1.24-1.26x" in best
    assert any("at any agreement: dice_int8" in line for line in lines)
    assert any("compiled float32" in line and "1.050x" in line and ": met" in line for line in lines)
    assert any("mixed corpus" in line and "2.400x" in line and ": met" in line for line in lines)


def test_each_target_can_fail_and_missing_rows_are_named():
    ours = [_peer("dice_fp32", 6000, 1.0), _peer("dice_compiled", 5900, 1.0), _peer("dice_bf16", 21000, 0.9999)]
    lines = cpu_check.verdict(PEERS + ours, [MIXED[0], {**MIXED[1], "tokens_per_s": "8000"}])
    assert any(line.startswith("best path dice_bf16") and "1.050x" in line and "NOT met" in line for line in lines)
    assert any("compiled float32" in line and "NOT met" in line for line in lines)
    assert any("mixed corpus" in line and "1.600x" in line and "NOT met" in line for line in lines)
    low = cpu_check.verdict(PEERS + [_peer("dice_int8", 40000, 0.98)], [])
    assert any("no dice_fast path reaches" in line for line in low)
    assert any("dice_compiled row is missing" in line for line in low)
    assert any("mixed corpus" in line and "missing" in line for line in low)
    assert cpu_check.verdict([], [])[0].startswith("best path: no peer or no dice_fast rows")


def test_the_bf16_target_does_not_apply_without_bf16_units():
    avx2 = [{**row, "isa": "avx2"} for row in PEERS + [_peer("dice_fp32", 6000, 1.0)]]
    lines = cpu_check.verdict(avx2, MIXED[:1])
    assert any("mixed corpus" in line and "does not apply" in line and "avx2" in line for line in lines)
    bf16 = [{**row, "isa": "avx2,avx512_bf16,avx512f"} for row in avx2]  # a bf16 CPU whose bf16 row is missing
    assert any("mixed corpus" in line and "missing" in line for line in cpu_check.verdict(bf16, MIXED[:1]))


def test_verdict_of_a_run_folder(tmp_path, capsys):
    from dice_fast.runinfo import append_csv

    append_csv(PEERS + [_peer("dice_bf16", 30000, 0.9999, "29000/31000")], tmp_path / "peers.csv")
    append_csv(MIXED, tmp_path / "mixed.csv")
    assert cpu_check.main(["--verdict", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1.500x" in out and "per round 1.48-1.53x" in out and "2.400x" in out


def test_latency_verdict_per_size_at_the_fastest_peers_agreement():
    def row(path, size, ms, cos):
        return {"path": path, "size": size, "tokens": "12" if size == "query" else "256", "median_ms": str(ms),
                "cos_min": str(cos)}
    rows = [row("st_torch_fp32", "query", 14.0, 1.0), row("st_onnx_fp32", "query", 5.0, 1.0),
            row("st_onnx_int8_dynamic", "query", 4.0, 0.98), row("dice_ov_fp32", "query", 6.0, 1.0),
            row("dice_fp32", "query", 15.0, 1.0),
            row("st_openvino", "chunk", 55.0, 1.0), row("dice_ov_fp32", "chunk", 50.0, 1.0),
            row("st_onnx_fp32", "passage", 14.0, 1.0), row("dice_int8", "passage", 9.0, 0.99)]
    lines = cpu_check.latency_verdict(rows)
    # the fastest peer is int8 (cos min 0.98): dice's float path, at cos 1.0 >= 0.98, against it
    assert lines[0] == ("latency, query (12 tokens): dice_ov_fp32 6.00 ms against the fastest peer "
                        "st_onnx_int8_dynamic 4.00 ms: 0.67x")
    assert lines[1].startswith("latency, chunk (256 tokens): dice_ov_fp32 50.00 ms") and lines[1].endswith("1.10x")
    assert lines[2] == "latency, passage: no dice_fast path reaches st_onnx_fp32's cos min 1.00000"
    assert cpu_check.latency_verdict([]) == []
