"""The compiled packed forward (`dice_fast.compiled`): exact against the per-chunk oracle, one graph
with no graph break across batch sizes, compile time reported, the padded fallback refused."""

from __future__ import annotations

import pytest
import torch

from dice_fast import DiceEncoder
from oracle import check, corpus
from tiny_models import tiny


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_compiled_matches_oracle_in_one_graph(arch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # the oracle's corpus in 40-token batches: token counts, chunk counts and runs of equal lengths
    # vary from batch to batch, and one batch holds a single run
    enc, _ = check(arch, texts=corpus() + corpus(seed=3, longest=90), compile="on")
    assert enc.runner.compiled is not None
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one dynamic graph: no recompile for a new batch size
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert f"compiled in {enc.runner.compiled.compile_seconds:.1f} s" in repr(enc)


def test_single_run_batches_share_the_graph():
    """A batch of equal-length chunks (one run) and one of many lengths reuse the first graph."""
    from torch._dynamo.utils import counters

    model, tok, *_ = tiny("bert")
    enc = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=64, compile="on", pooling_impl="torch")
    before = counters["stats"]["unique_graphs"]
    eager = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=64, pooling_impl="torch")
    for texts in (["the cat sat on a mat and dog ran"] * 5, [" ".join(["sky"] * n) for n in (1, 3, 9, 17, 30)]):
        got, want = enc.encode_documents(texts), eager.encode_documents(texts)
        assert abs(got - want).max() < 1e-5
    assert counters["stats"]["unique_graphs"] == before


def test_padded_fallback_is_refused():
    model, tok, *_ = tiny("mpnet")
    with pytest.raises(ValueError, match="padded"):
        DiceEncoder(model, tok, chunk_size=8, compile="on")
    bert, bert_tok, *_ = tiny("bert")  # the padded backend chosen: refused too (it was accepted and ignored)
    with pytest.raises(ValueError, match="compile='on' compiles the packed forward.*runs on padded"):
        DiceEncoder(bert, bert_tok, chunk_size=8, compile="on", attention_backend="padded")
    with pytest.raises(ValueError, match="compile"):
        DiceEncoder(model, tok, chunk_size=8, compile="yes")


@pytest.mark.parametrize("cause", ["no C++ compiler", "TORCH_COMPILE_DISABLE"])
def test_where_nothing_can_compile_on_is_refused_and_auto_runs_eager(cause, monkeypatch, tmp_path):
    """Inductor builds CPU kernels with a C++ compiler: where it finds none, compile='on' says so before
    tracing anything. TORCH_COMPILE_DISABLE=1 makes torch.compile run everything eagerly: compile='on'
    failed deep in the probe with torch's "found no compiled frames" and hundreds of skipped frames; now
    it is refused naming the variable. Either way compile='auto' leaves the compiled paths out."""
    from dice_fast import compiled, cpu_paths

    monkeypatch.setenv("DICE_FAST_CACHE_DIR", str(tmp_path))
    if cause == "no C++ compiler":
        monkeypatch.setattr(compiled, "BACKEND", "inductor")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
        refusal = "compile='on': torch.compile builds .* C\\+\\+ compiler and finds none.*no-such-g"
    else:
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")  # (torch read it at import: here only the check sees it)
        refusal = (r"compile='on': torch.compile is turned off in this process \(TORCH_COMPILE_DISABLE=1 in the "
                   r"environment: unset it\); or use compile='off'")
    model, tok, *_ = tiny("bert")
    with pytest.raises(ValueError, match=refusal):
        DiceEncoder(model, tok, chunk_size=8, compile="on")
    measured = []
    monkeypatch.setattr(cpu_paths, "measure_paths", lambda encs, ref: (measured.append(sorted(encs)) or
                                                                      ({n: 1.0 for n in encs}, {n: 1.0 for n in encs}, True)))
    enc = DiceEncoder(model, tok, chunk_size=8, compile="auto", runtime="torch", pooling_impl="torch")
    assert enc.runner.compiled is None and measured == [["fp32"]]


@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_the_cuda_varlen_forward_traces_whole_on_the_cpu(arch, monkeypatch):
    """compile='on' with a CUDA varlen backend, run on the CPU: a fake of torch's varlen_attn (torch >=
    2.12's signature: GQA heads unrepeated) stands in for the kernel, the forward is traced in one graph
    around the dice_fast::varlen op and its fake ("aot_eager": the graph inductor gets, no code
    generation), and its vectors are the eager varlen forward's and the sdpa_groups engine's."""
    from torch._dynamo.utils import counters

    import dice_fast.compiled as compiled
    import dice_fast.runner as runner
    from dice_fast import attention as attn
    from test_attention import fake_new

    attn._torch_varlen_params.cache_clear()
    monkeypatch.setattr(attn, "_torch_varlen_func", lambda: fake_new)
    monkeypatch.setattr(runner, "COMPILED_BACKENDS", {"cpu": ("sdpa_groups", "torch_varlen")})
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    model, tok, *_ = tiny(arch)
    texts = corpus(seed=2, longest=60)
    want = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=40, pooling_impl="torch")
    got = {}
    try:
        for compile_ in (False, True):
            enc = DiceEncoder(model, tok, chunk_size=8, max_batch_tokens=40, pooling_impl="torch")
            s = enc.settings
            enc.runner = runner.ModelRunner(model, s.spec, "torch_varlen", s.causal, s.pooling, s.pooling_impl,
                                            s.max_batch_tokens, tok.pad_token_id, compile=compile_)
            assert enc.backend == "torch_varlen" and (enc.runner.compiled is not None) == compile_
            got[compile_] = enc.encode_documents(texts)
    finally:
        attn._torch_varlen_params.cache_clear()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    ref = want.encode_documents(texts)
    assert abs(got[True] - got[False]).max() < 1e-5 and abs(got[True] - ref).max() < 1e-5


def test_the_varlen_op_has_a_fake_and_cuda_backends_are_allowed():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dice_fast import attention_op
    from dice_fast.runner import COMPILED_BACKENDS

    with FakeTensorMode():
        q, k = torch.empty(50, 8, 16, dtype=torch.bfloat16), torch.empty(50, 2, 16, dtype=torch.bfloat16)
        out = torch.ops.dice_fast.varlen(q, k, k, torch.empty(4, dtype=torch.int32), torch.empty(1, dtype=torch.int64),
                                         True, 0.25, 0, "torch_varlen")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert attention_op.max_len_tensor(258).tolist() == [258]
    assert set(COMPILED_BACKENDS["cuda"]) == {"sdpa_groups", "flash_attn", "torch_varlen"}
    assert COMPILED_BACKENDS["cpu"] == ("sdpa_groups",)


def test_compile_options_never_pass_a_mode_with_options(monkeypatch):
    import dice_fast.compiled as compiled

    assert compiled.compile_options("cpu") == compiled.compile_options("cuda") == {"options": {"freezing": True}}
    monkeypatch.setattr(compiled, "CUDA_MODE", "max-autotune-no-cudagraphs")
    assert compiled.compile_options("cuda") == {"mode": "max-autotune-no-cudagraphs"}
    assert compiled.compile_options("cpu") == {"options": {"freezing": True}}
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    assert compiled.compile_options("cuda") == {}
