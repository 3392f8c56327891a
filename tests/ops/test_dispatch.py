"""The ops' one argument list (`spec.SCHEMAS`), the dispatcher, and whether Triton is really available.

* Every implementation spells the argument list of `spec.SCHEMAS` (names, order, defaults): the
  Triton ops are declared from it, the C++ library defines it character for character
  (csrc/register.cpp, checked here without building; the loaded ops in test_native.py), and the
  Python functions repeat it.
* `resolve_impl` / `implementation` map names to functions; ``"auto"`` picks ``torch`` on a CPU
  without the C++ extension, and importing or calling the ops that way imports no Triton.
* `triton_pool.available()` says whether the kernels run, in both directions (nothing here is
  skipped when Triton is missing: then it must say False).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dice_fast import ops
from dice_fast.ops import spec
from helpers import TOLERANCES, assert_close

REPO = Path(__file__).resolve().parents[2]
OPS = tuple(spec.SCHEMAS)


def _schema_args(op: str) -> list[tuple[str, object]]:
    """(name, default) of each argument of ``op``'s schema; default is inspect's ``empty`` when none."""
    parsed = torch._C.parse_schema(f"x::{op}{spec.SCHEMAS[op]}")
    return [(a.name, a.default_value if a.has_default_value() else inspect.Parameter.empty) for a in parsed.arguments]


def _python_args(fn) -> list[tuple[str, object]]:
    fn = getattr(fn, "_init_fn", fn)  # a torch.library CustomOpDef: the function it wraps
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


# --------------------------------------------------------------------------------------------
# the schema, written once
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_schema_parses_and_returns_one_tensor(op):
    parsed = torch._C.parse_schema(f"dice_fast::{op}{spec.SCHEMAS[op]}")
    assert [str(r.type) for r in parsed.returns] == ["Tensor"]
    assert not any(a.alias_info for a in parsed.arguments), "the ops mutate nothing"


@pytest.mark.parametrize("impl", list(ops.IMPLEMENTATIONS))
@pytest.mark.parametrize("op", OPS)
def test_python_implementations_spell_the_schema(op, impl):
    assert _python_args(ops.implementation(op, impl)) == _schema_args(op), f"{impl} {op}"


@pytest.mark.parametrize("op", OPS)
def test_public_dispatchers_spell_the_schema_plus_impl(op):
    assert _python_args(getattr(ops, op)) == _schema_args(op) + [("impl", "auto")]


def test_triton_registered_ops_and_fakes_use_the_schema():
    from dice_fast.ops import triton_pool as tp

    for op, fns in {"pool_chunks": (tp._pool_chunks_op, tp._pool_chunks_fake),
                    "aggregate_documents": (tp._aggregate_op, tp._aggregate_fake)}.items():  # fmt: skip
        registered = getattr(torch.ops.dice_fast, f"{op}_triton").default._schema
        assert str(registered) == str(torch._C.parse_schema(f"dice_fast::{op}_triton{spec.SCHEMAS[op]}"))
        for fn in fns:
            assert _python_args(fn) == _schema_args(op), fn


def _cpp_schemas() -> dict[str, str]:
    """The schema strings csrc/register.cpp gives ``m.def`` in its TORCH_LIBRARY block (adjacent raw
    string literals joined, as the compiler does)."""
    src = (REPO / "csrc" / "register.cpp").read_text()
    block = re.search(r"TORCH_LIBRARY\(dice_fast_C, m\) \{(.*?)\n\}", src, re.S)
    assert block, "no TORCH_LIBRARY(dice_fast_C, m) block in csrc/register.cpp"
    defs = {}
    for piece in block.group(1).split("m.def(")[1:]:
        text = "".join(re.findall(r'R"\((.*?)\)"', piece, re.S))
        name = text.split("(", 1)[0]
        defs[name] = text[len(name):]
    return defs


def test_cpp_library_defines_the_schema():
    assert _cpp_schemas() == spec.SCHEMAS  # the literal text: a difference is a drift to fix on one side


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------
def test_resolve_impl_names():
    cpu = torch.device("cpu")
    assert ops.resolve_impl("ref", cpu) == "reference"  # alias kept for callers of the old name
    for impl in ops.IMPLEMENTATIONS:
        assert ops.resolve_impl(impl, cpu) == impl
    with pytest.raises(ValueError, match="unknown pooling implementation"):
        ops.resolve_impl("fast", cpu)
    from dice_fast.ops import native

    assert ops.resolve_impl("auto", cpu) == ("native" if native.is_loaded() else "torch")
    assert ops.resolve_impl("auto", "meta") == "torch"
    assert ops.implementation("pool_chunks", "reference") is spec.pool_chunks_ref
    assert ops.implementation("aggregate_documents", "torch").__module__ == "dice_fast.ops.torch_pool"


@pytest.mark.parametrize("impl", ["torch", "reference", "ref"])
def test_dispatchers_pass_every_argument_through(impl):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 6, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 5, 12], dtype=torch.int32)
    cu_doc = torch.tensor([0, 2, 3], dtype=torch.int64)
    w = torch.rand(3, generator=g)
    chunks = ops.pool_chunks(hidden, cu, "last", impl=impl)
    assert_close(chunks, spec.pool_chunks_ref(hidden, cu, "last"), *TOLERANCES[torch.float32])
    # non-default values everywhere: a dropped argument would change the result
    for args in [(w, "softmax_norm", 1, 0.3, True, False), (w, "topk_norm", 1, 1.0, False, False),
                 (w, "weighted_mean", 1, 1.0, True, True)]:  # fmt: skip
        got = ops.aggregate_documents(chunks, cu_doc, *args, impl=impl)
        assert_close(got, spec.aggregate_documents_ref(chunks, cu_doc, *args), *TOLERANCES[torch.float32], what=args[1])


# --------------------------------------------------------------------------------------------
# fresh processes: what "auto" picks, what gets imported, whether triton's available() tells the truth
# --------------------------------------------------------------------------------------------
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import dice_fast, dice_fast.ops as ops
    out = {"auto_cpu": ops.resolve_impl("auto", torch.device("cpu"))}
    hidden, cu = torch.randn(7, 4), torch.tensor([0, 3, 7], dtype=torch.int32)
    ops.segment_pool(hidden, cu, torch.tensor([0, 2]), aggregation="topk_norm", top_k=1)
    out["imported_triton"] = "triton" in sys.modules or "dice_fast.ops.triton_pool" in sys.modules
    from dice_fast.ops import triton_pool as tp
    out["available"] = tp.available()
    try:
        got = tp.pool_chunks_triton(hidden, cu, "mean")
        out["ran"] = bool(torch.allclose(got, ops.pool_chunks(hidden, cu, impl="reference"), atol=1e-5))
    except RuntimeError as e:
        out["ran"], out["error"] = False, str(e)
    print(json.dumps(out))
    """
)


def _probe(**env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", **env_changes)
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_triton_available_says_whether_the_kernels_run():
    """No GPU visible: without the interpreter available() is False and a call says how to get it;
    with TRITON_INTERPRET=1 it is True exactly when triton imports, and then the kernels run."""
    has_triton = importlib.util.find_spec("triton") is not None
    off = _probe()
    assert off["available"] is False and off["ran"] is False, off
    assert "TRITON_INTERPRET=1" in off["error"] or "pip install triton" in off["error"], off
    on = _probe(TRITON_INTERPRET="1")
    assert on["available"] is has_triton and on["ran"] is has_triton, on
    # the CPU default needs neither triton nor the C++ extension, and does not import triton
    for probe in (off, on):
        assert probe["auto_cpu"] == "torch" and probe["imported_triton"] is False, probe


def test_triton_available_in_this_process():
    """The same in this process (TRITON_INTERPRET is set by conftest when there is no GPU)."""
    from dice_fast.ops import triton_pool as tp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, cu = torch.randn(7, 4, device=device), torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    expected = importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    )
    assert tp.available() is expected
    if expected:
        assert_close(tp.pool_chunks_triton(hidden, cu), spec.pool_chunks_ref(hidden, cu), *TOLERANCES[torch.float32])
    else:
        with pytest.raises(RuntimeError, match="triton|TRITON_INTERPRET"):
            tp.pool_chunks_triton(hidden, cu)
