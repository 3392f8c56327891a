"""The tree shows the architecture: no import cycles, consumers of the core never import each other,
modules stay small, and `import dice_fast` loads no optional extra."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dice_fast"
# each consumer of the core's public API: a subpackage that never imports a sibling (nor the CLI root)
CONSUMERS = ("eval", "bench", "serve", "integrations", "corpus", "index")
KERNELS = {"ops/triton_pool.py"}  # kernels may run longer than the module limit
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every dice_fast module ``path`` imports, at module level or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dice_fast"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "dice_fast":
                continue
            found.add(target)
            for alias in node.names:  # `from . import attention` imports a module
                if (PACKAGE.parent / Path(*f"{target}.{alias.name}".split("."))).with_suffix(".py").exists():
                    found.add(f"{target}.{alias.name}")
    return found - {name}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    g = {}
    for name, path in modules.items():
        deps = set()
        for target in imports_of(path):
            while target and target not in modules:  # `from dice_fast.ops.spec import X` -> the module
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                deps.add(target)
        g[name] = deps
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    g = graph()
    assert "dice_fast.engine" in g and "dice_fast.runner" in g["dice_fast.engine"]  # the walker sees imports
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_consumers_never_import_a_sibling(consumer):
    g = graph()
    mine = [m for m in g if m.startswith(f"dice_fast.{consumer}")]
    assert mine, f"dice_fast/{consumer}/ is missing"
    forbidden = {f"dice_fast.{c}" for c in CONSUMERS if c != consumer} | {"dice_fast.cli"}
    bad = sorted((m, d) for m in mine for d in g[m] if any(d == f or d.startswith(f + ".") for f in forbidden))
    assert not bad, f"{consumer} imports a sibling: {bad}"


def test_core_never_imports_a_consumer():
    g = graph()
    core = [m for m in g if not any(m.startswith(f"dice_fast.{c}") for c in (*CONSUMERS, "cli"))]
    bad = sorted((m, d) for m in core for d in g[m] if any(d.startswith(f"dice_fast.{c}") for c in CONSUMERS))
    assert not bad, f"the core imports a consumer: {bad}"


def test_modules_stay_small():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
            and str(p.relative_to(PACKAGE)) not in KERNELS}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_lean_import_loads_no_extra():
    code = (
        "import sys, dice_fast, dice_fast.ops, dice_fast.quant, dice_fast.serve, dice_fast.integrations, dice_fast.cli\n"
        "dice_fast.cli.build_parser()\n"
        "import torch\n"
        "heavy = [m for m in ('transformers', 'triton', 'flash_attn', 'flash_attn_interface', 'fastapi', 'uvicorn',"
        " 'httpx', 'ray', 'mteb', 'pyarrow', 'sentence_transformers', 'matplotlib', 'langchain_core', 'llama_index',"
        " 'openai', 'openvino', 'nncf', 'dice_fast.ops.native',"
        " 'dice_fast.ops.triton_pool') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_lines_help_loads_no_torch():
    """``dice-fast --help`` and every subcommand's parser come up without torch (it took ~2.5 s of a
    ~3 s ``--help``): the settings read the ops' names from `dice_fast.ops.names`."""
    code = ("import sys, dice_fast.cli\n"
            "dice_fast.cli.build_parser()\n"
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('dice_fast')]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Private names stay in their module. The rule, for dice_fast/ and benchmarks/:
# * ``x._name`` (not a dunder) only where x is ``self``, ``cls`` or ``super()``: an object's own state;
# * ``from m import _name`` never (a private module, e.g. ``eval/_arrays.py``, is imported only from its
#   own package, where its public names are the package's internals);
# * third-party private names dice_fast has to read are listed in THIRD_PARTY_PRIVATE, each with why.
# Tests may read the private names of the module they test (white-box checks); public seams exist for
# what a test of another module needs (e.g. the engine's tokenizer, the ``dedup`` option).
THIRD_PARTY_PRIVATE = {
    "_attn_implementation",  # transformers' config field that selects the attention function
    "_global_mapping",  # transformers' AttentionInterface registry of attention functions
    "_C", "_dispatch_has_kernel_for_dispatch_key",  # torch's dispatcher: is an op registered for a key
    "_actions",  # argparse's list of a parser's actions (the only way to walk its flags)
    "_flash_attention_forward",  # torch's flash kernel: GQA unrepeated where varlen_attn has no enable_gqa (2.11)
    "_linear_pointwise",  # torch's oneDNN linear (what inductor emits): 2.4x MKL's fp32 sgemm on AMD (cpu_linear)
    # torch's hook registries (no public way to ask whether a module has hooks): a hook that could see
    # a linear's output keeps it out of the GELU fusion (cpu_fusion)
    "_forward_hooks", "_forward_pre_hooks", "_global_forward_hooks", "_global_forward_pre_hooks",
    "_backward_hooks", "_backward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks",
    "_exit",  # os._exit, documented: `dice-fast serve` ends without joining a thread left inside a forward
}
ROOT = PACKAGE.parent
# a GPU preflight inspects the Triton kernels' launch internals and attention's probes by design
PRIVATE_READERS = {"benchmarks/preflight.py"}


def private_uses(path: Path) -> list[str]:
    """Every private name ``path`` reads from another object or module (see the rule above)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__"):
            v = node.value
            own = (isinstance(v, ast.Name) and v.id in ("self", "cls")) or (
                isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")
            if not own and node.attr not in THIRD_PARTY_PRIVATE:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
            if node.module and any(p.startswith("_") and not p.endswith("__") for p in node.module.split(".")) and not node.level:
                names.append(node.module)  # an absolute import of a private module: from outside its package
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {n}" for n in names]
    return found


def test_private_use_finder_finds_what_it_should():
    probe = ROOT / "tests" / "_layout_probe.py"
    probe.write_text("from m import _x\nfrom dice_fast.eval._arrays import y\nself._a; cls._b; super()._c\n"
                     "other._d; a.b._e; x.__dict__; cfg._attn_implementation\n")
    try:
        got = [line.split(": ", 1)[1] for line in private_uses(probe)]
    finally:
        probe.unlink()
    assert sorted(got) == sorted(["from m import _x", "from dice_fast.eval._arrays import dice_fast.eval._arrays",
                                  "other._d", "a.b._e"])


def test_no_module_reads_another_modules_private_names():
    files = [p for p in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
             if str(p.relative_to(ROOT)) not in PRIVATE_READERS]
    bad = [use for p in files for use in private_uses(p)]
    assert not bad, "private names read across modules:\n" + "\n".join(bad)


def test_the_queue_imports_nothing_of_the_engine():
    """The queue is built from settings, a runner and a reuse object; it never climbs back up."""
    g = graph()

    def reach(name, seen=None):
        seen = set() if seen is None else seen
        for d in g[name]:
            if d not in seen:
                seen.add(d)
                reach(d, seen)
        return seen

    assert "dice_fast.engine" not in reach("dice_fast.chunk_queue")
    assert "dice_fast.engine" not in reach("dice_fast.reuse.manager")
    assert not any(m.startswith("dice_fast.engine") for m in g["dice_fast.aggregation"] | g["dice_fast.settings"])


def test_reuse_is_one_package():
    """Chunk identity, the memory store, the persistent store and the dedup bookkeeping live in
    dice_fast/reuse/ and nowhere else."""
    assert sorted(p.name for p in (PACKAGE / "reuse").glob("*.py")) == [
        "__init__.py", "cache_files.py", "keys.py", "manager.py", "memory.py", "persistent.py"]
    strays = [p.name for p in PACKAGE.glob("*.py") if p.stem in ("reuse", "chunk_cache", "scheduler_reuse")]
    assert not strays, strays
    owners = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name in ("ChunkKeys", "MemoryCache", "ChunkStats", "ChunkCache",
                                                                  "ChunkReuse", "CacheNamespace"):
                owners[node.name] = p.parent.name
    assert set(owners.values()) == {"reuse"} and len(owners) == 6, owners


# the compiled kernels' build and launch errors stay RuntimeError (ops/native.py, ops/triton_pool.py)
KERNEL_SOURCES = {"ops/native.py", "ops/triton_pool.py"}
# raised by the core besides its own errors: a module's __getattr__, and a broken invariant (a bug)
NOT_USER_ERRORS = {"AttributeError", "RuntimeError"}


def core_modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in (*CONSUMERS, "cli.py")
            and str(p.relative_to(PACKAGE)) not in KERNEL_SOURCES]


def test_every_core_error_derives_from_dice_error():
    import dice_fast
    from dice_fast import errors

    mine = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert len(mine) >= 9
    for name in mine:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DiceError) and getattr(dice_fast, name) is cls, name
    assert issubclass(errors.OptionError, ValueError) and issubclass(errors.InputOutOfMemory, RuntimeError)
    classes, raised = _errors_of(core_modules(), mine)
    assert all(c.startswith("dice_fast/errors.py") for c in classes), f"error classes outside errors.py: {classes}"
    assert not raised, "the core raises errors that are not DiceErrors:\n" + "\n".join(raised)


def test_the_index_raises_dice_errors():
    """`dice_fast.DiceIndex` is public beside the encoder: its bad options and inputs raised plain
    ValueErrors where the encoder's raise OptionError / InputError (a sequence's IndexError stays)."""
    from dice_fast import errors

    mine = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    _, raised = _errors_of(sorted((PACKAGE / "index").rglob("*.py")), mine | {"IndexError"})
    assert not raised, "the index raises errors that are not DiceErrors:\n" + "\n".join(raised)


def _errors_of(paths, allowed) -> tuple[list[str], list[str]]:
    """The exception classes defined in ``paths`` and their ``raise X(...)`` of a class X not in
    ``allowed`` (nor `NOT_USER_ERRORS`; a lower-case name is a function that makes the error)."""
    classes, raised = [], []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and (
                    b.id.endswith("Error") or b.id in ("Exception", "BaseException")) for b in node.bases):
                classes.append(f"{p.relative_to(ROOT)}: {node.name}")
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                if node.exc.func.id[0].isupper() and node.exc.func.id not in allowed | NOT_USER_ERRORS:
                    raised.append(f"{p.relative_to(ROOT)}:{node.lineno}: raise {node.exc.func.id}")
    return classes, raised
