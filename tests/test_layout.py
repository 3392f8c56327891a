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
