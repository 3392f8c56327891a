"""The frozen Hugging Face model exported to OpenVINO: quantized statically by NNCF (int8), or as it is
(float32 / bfloat16), and compiled for the CPU with a fixed-length twin.

    compiled = int8_model(model, calibration, cache_root, fingerprint, takes_positions, threads, streams, width=256)
    compiled = float_model(model, "bfloat16", cache_root, fingerprint, takes_positions, threads, streams, width=256)
    compiled.dynamic, compiled.fixed, compiled.identity   # any shape; length fixed at 256; cache namespace
    compiled.latency.get()   # streams > 1: the dynamic model as one latency stream, compiled on first use

``calibration`` is a list of (ids, positions) pairs, (1, L) int64 each: wrapped chunks exactly as the
engine runs them. Static quantization fixes every activation scale at calibration, so a chunk's
vector depends on its own tokens only, never on its batch neighbours (dynamic int8 rescales per
batch, which would break the chunk cache's "a vector is a function of its chunk").

The quantized model is cached on disk under ``cache_root/int8/<key>/`` where ``key`` hashes the model
fingerprint (every weight), the calibration set's hash, the recipe, the OpenVINO / NNCF versions and
the torch / transformers minor versions: another model, calibration or library version never hits;
the float export under ``cache_root/openvino/<key>/`` (model fingerprint and the same versions but
NNCF's); written, checked and repaired by `dice_fast.quant.model_cache`. A process keeps the compiled
models it loaded, so encoders sharing a model (evaluation twins) compile once.

Why OpenVINO for the float precisions too: its fused CPU graph (attention, LayerNorm, GELU and the
GEMMs in one compiled model, run as one stream per core) ran MiniLM at bf16 ~1.4x dice_fast's eager
PyTorch bf16 on the Zen 5 (RESULTS §16.8, §17), the ops PyTorch runs one by one at hidden size 384.

Why OpenVINO (measured on the 2-core Zen 4 with avx512_vnni, busy machine, see docs/int8.md): static
int8 here ran ~3.3x PyTorch fp32 on 256-token chunks; ONNX Runtime's int8 (dynamic, what
sentence-transformers offers) ran 2.2x at a lower cos min (0.970 against 0.99); PyTorch's own x86
static int8 (PT2E) needs the packed forward exported and compiled, which the eager packed forward
cannot be without the compiled path.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError, OptionError
from .cpu import int8_dot_instructions, tracing_off
from .model_cache import read_or_write, save

# NNCF's transformer preset (softmax, LayerNorm and GELU stay in floating point) with SmoothQuant at
# alpha 0.7 on the matmuls (NNCF's default is 0.95). Chosen on text that neither calibration nor the
# held-out agreement uses (benchmarks/int8_recipe.py on benchmarks/data/sample.jsonl; MiniLM, 300
# chunks of 254 tokens each): worst chunk cosine 0.9956 at 0.7 against 0.9874 at 0.95 and 0.988-0.989
# at 0.85-0.9, whose calibration cosines looked best (RESULTS §16). Changing any of these changes the key.
RECIPE = {"backend": "openvino+nncf", "model_type": "transformer", "preset": "mixed", "subset_size": 300,
          "smooth_quant_alpha": 0.7}
# compiled models by (folder, properties, width), while an encoder holds one or it is among the last
# `_KEEP` compiled (dtype="auto"'s chosen path reuses its candidate's): a process that loaded model after
# model kept every one compiled (~80 MB each for a 4-layer model in a review's soak)
_MEMO: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEEP = 4
_RECENT: deque = deque(maxlen=_KEEP)
_LOCK = threading.Lock()
_CORE: list = []  # the process's one ov.Core (see _core)


def _versions() -> dict:
    """OpenVINO's and NNCF's versions, and the minor versions of torch and transformers (the exporter
    traces transformers' modelling code: another release may export another graph)."""
    import nncf

    return {**_float_versions(), "nncf": nncf.__version__}


def _float_versions() -> dict:
    import openvino as ov

    from ..runinfo import minor_versions

    return {"openvino": ov.__version__.split("-")[0], **minor_versions()}


def calibration_hash(calibration) -> str:
    """SHA-256 (hex) of a calibration set: its (ids, positions) arrays, in order."""
    h = hashlib.sha256()
    for ids, pos in calibration:
        h.update(np.asarray(ids, np.int64).tobytes() + b"|" + np.asarray(pos, np.int64).tobytes() + b";")
    return h.hexdigest()


def recipe_hash() -> str:
    """SHA-256 (hex) of `RECIPE`: named in the identity, so the chunk cache never mixes two recipes' vectors."""
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()


def cache_key(fingerprint: str, calibration_digest: str, versions: dict | None = None,
              attention: str | None = None) -> str:
    """The folder name of one quantized model: (model fingerprint, calibration hash, recipe, versions, and
    the export's attention where `export_attention` sets one)."""
    blob = json.dumps({"model": fingerprint, "calibration": calibration_digest, "recipe": RECIPE,
                       **(versions or _versions()), **({"attention": attention} if attention else {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def export_attention(model) -> str | None:
    """The attention implementation the export gives ``model`` where it is not the model's own: "eager"
    for a model with a sliding window (OpenVINO's SDPA turns a padded position whose window holds no real
    key into NaN, and the next layer spreads it to the row's real tokens), else None."""
    from ..runner import sliding_window

    return "eager" if sliding_window(model.config) is not None else None


class _Dense(torch.nn.Module):
    """(input_ids, attention_mask[, position_ids]) (B, L) -> last_hidden_state (B, L, H)."""

    def __init__(self, model, takes_positions: bool):
        super().__init__()
        self.model, self.takes_positions = model, takes_positions
        # a decoder's KV cache is a Python object the exporter cannot convert; one forward needs none
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, input_ids, attention_mask, position_ids=None):
        kw = {"position_ids": position_ids} if self.takes_positions else {}
        if self.no_cache:
            kw["use_cache"] = False
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state


def _feed(ids: np.ndarray, pos: np.ndarray, takes_positions: bool) -> dict:
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if takes_positions:
        feed["position_ids"] = pos
    return feed


def _export(model, takes_positions: bool, ids: np.ndarray, pos: np.ndarray):
    """``model`` as a float32 OpenVINO model with inputs (rows, length) free; ``ids`` / ``pos`` (1, L)
    int64: one example to trace with. `OptionError` where `tracing_off` says why it cannot be."""
    import openvino as ov

    if why := tracing_off():
        raise OptionError(f"{why}; or use runtime='torch'")

    from .. import attention as attn

    twin = copy.deepcopy(model).float().eval()  # the caller's model is never touched
    if attn.installed(twin):
        attn.uninstall(twin)
    attention = export_attention(twin)
    if attention:
        twin.set_attn_implementation(attention)
    names = ["input_ids", "attention_mask"] + (["position_ids"] if takes_positions else [])
    ids, pos = (torch.from_numpy(np.repeat(np.asarray(a, np.int64), 2, axis=0)) for a in (ids, pos))
    mask = torch.ones_like(ids)
    mask[1, max(ids.shape[1] // 2, 1):] = 0  # a padded row: an all-ones example lets transformers drop the mask
    example = {"input_ids": ids, "attention_mask": mask}
    if takes_positions:
        example["position_ids"] = pos
    with torch.no_grad():
        # torch.jit.trace's check_trace (on by default; convert_model cannot turn it off) traces the
        # module again to compare, and TorchScript keeps ~2.5 MB per transformer layer of that check
        # for the life of the process (per traced op, whatever the hidden size); the graph is the same
        inputs = [(n, [-1, -1], ov.Type.i64) for n in names]
        try:
            from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder

            decoder = TorchScriptPythonDecoder(_Dense(twin, takes_positions), example_input=example,
                                               trace_kwargs={"check_trace": False})
        except (ImportError, TypeError):  # an OpenVINO whose decoder takes no trace_kwargs: its own trace
            return ov.convert_model(_Dense(twin, takes_positions), example_input=example, input=inputs)
        return ov.convert_model(decoder, input=inputs)


def _quantize(fp, calibration, takes_positions: bool):
    """The float OpenVINO model ``fp`` statically quantized by NNCF with `RECIPE` on ``calibration``."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    data = nncf.Dataset([_feed(i, p, takes_positions) for i, p in calibration])
    smooth = AdvancedSmoothQuantParameters(matmul=RECIPE["smooth_quant_alpha"])
    return nncf.quantize(fp, data, model_type=nncf.ModelType.TRANSFORMER, preset=nncf.QuantizationPreset.MIXED,
                         subset_size=min(RECIPE["subset_size"], len(calibration)),
                         advanced_parameters=AdvancedQuantizationParameters(smooth_quant_alphas=smooth))


def _export_and_quantize(model, calibration, takes_positions: bool, out: Path) -> None:
    save(_quantize(_export(model, takes_positions, *calibration[0]), calibration, takes_positions), out)


def _export_float(model, takes_positions: bool, out: Path) -> None:
    example = np.arange(1, 9, dtype=np.int64)[None]  # any ids trace: the graph does not depend on them
    save(_export(model, takes_positions, example, example - 1), out)


class LatencyTwin:
    """The model compiled as one latency stream on every inference thread, on first use (`get`), for a
    throughput model's batches of fewer rows than it has streams: one request on one stream leaves the
    other threads idle, so one row ran ~1.6-1.7x faster this way (2-core Zen 2, MiniLM float32, 12 to
    256 tokens; RESULTS §35), while two or more rows mostly ran as fast or faster on the streams (two
    rows of 12 tokens: 1.13x here, of 70: 0.88x). The same graph and precision: vectors agree with the
    throughput model's to float rounding."""

    def __init__(self, core, read, props: dict):
        self._core, self._read, self._props, self._model = core, read, props, None
        self._lock = threading.Lock()  # its own: `_LOCK` is held through other models' exports (minutes for int8)

    def get(self):
        """The compiled latency model (compiled by the first call, ~0.2 s for MiniLM). Thread-safe."""
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self._core.compile_model(self._read, "CPU", self._props)
        return self._model


def latency_properties(props: dict) -> dict:
    """``props`` (`compile_properties`) for one latency stream on the same threads and precision."""
    out = {k: v for k, v in props.items() if k not in ("PERFORMANCE_HINT", "NUM_STREAMS")}
    return {**out, "PERFORMANCE_HINT": "LATENCY"}


@dataclass(frozen=True)
class OpenVinoModel:
    """A model compiled for one runner: ``dynamic`` takes (rows, length) of any size; ``fixed`` (None
    without a width) is the same model with the length fixed at ``width`` (rows still free):
    OpenVINO's CPU kernels run a known sequence length ~1.1x faster (RESULTS §16), and full chunks,
    the bulk of a long-document corpus, all have that length. ``identity`` names the precision,
    backend and versions and the model's (and int8's recipe and calibration) hashes: the chunk cache's
    namespace for these vectors (`encoder.precision`); ``runs``: the precision OpenVINO runs the
    float ops in; ``latency``: a throughput model's `LatencyTwin` (None where ``dynamic`` is one
    latency stream already)."""

    dynamic: object
    fixed: object
    width: int | None
    identity: str
    runs: str = "f32"  # the precision OpenVINO runs the float ops in ("f32" / "bf16")
    latency: LatencyTwin | None = None  # a throughput model's latency twin (None: ``dynamic`` is one)


def compile_properties(threads: int, streams: int, hints: dict | None = None) -> dict:
    """OpenVINO CPU compile properties: ``streams`` <= 1 one latency stream on ``threads`` threads, more a
    throughput model sharing them; ``hints`` added last (``INFERENCE_PRECISION_HINT`` ...)."""
    props = {"INFERENCE_NUM_THREADS": int(threads)}
    props.update({"PERFORMANCE_HINT": "LATENCY"} if streams <= 1 else
                 {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": int(streams)})
    props.update(hints or {})
    return props


def _load(folder: Path, write, props: dict, width: int | None, name) -> OpenVinoModel:
    """``folder/model.xml`` (written by ``write(folder)`` when absent) compiled with ``props``, a
    fixed-length twin at ``width``; ``name(float_parts)`` -> the identity. Memoised per process."""
    import openvino as ov

    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise InputError(f"OpenVINO fixed width must be a positive token count, got {width!r}")
    memo = (str(folder), json.dumps(props, sort_keys=True), width)
    with _LOCK:
        found = _MEMO.get(memo)  # (a weak entry may go between a test and a read)
        if found is not None:
            return found
        core = _core()
        read = read_or_write(core, folder, write)
        dynamic = core.compile_model(read, "CPU", props)
        fixed = None
        if width is not None:
            twin = read.clone()  # the read model, not a second read of the file
            twin.reshape({p.get_any_name(): ov.PartialShape([-1, int(width)]) for p in twin.inputs})
            fixed = core.compile_model(twin, "CPU", props)
        # the precision the float ops really run in (int8: OpenVINO's per-CPU default, bf16 where the
        # CPU has it): named, since it shifts vectors (within the stated agreement)
        rest = dynamic.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # "bf16" / "f32"
        latency = LatencyTwin(core, read, latency_properties(props)) if props.get("PERFORMANCE_HINT") == "THROUGHPUT" else None
        compiled = _MEMO[memo] = OpenVinoModel(dynamic, fixed, width, name(rest), rest, latency)
        _RECENT.append(compiled)
        return compiled


def _core():
    """The process's one ``ov.Core``, made on first use and never destroyed (called under `_LOCK`).
    OpenVINO's CPU plugin, one per Core, gives the thread that first compiles on it an alternate signal
    stack of its own, and when destroyed restores the one it found and unmaps its own: Cores that went
    in another order than they came (two encoders, or `dtype="auto"`'s candidates, freed oldest first)
    left the thread on an unmapped stack, and its next signal (Ctrl-C, SIGTERM, a timer) was a
    segmentation fault instead of an interrupt."""
    import openvino as ov

    if not _CORE:
        _CORE.append(ov.Core())
    return _CORE[0]


def int8_model(model, calibration, cache_root: Path, fingerprint: str, takes_positions: bool, threads: int,
               streams: int = 1, hints: dict | None = None, width: int | None = None) -> OpenVinoModel:
    """``model`` quantized with ``calibration`` and compiled (`OpenVinoModel`).

    model: the float Hugging Face model (read only); calibration: [(ids, positions)] of (1, L) int64,
    at least one; cache_root: folder holding ``int8/<key>/model.xml``; fingerprint: the model's
    (`model_fingerprint`); threads: inference threads; streams: OpenVINO streams (1: one latency
    stream using every thread; more: a throughput model, threads shared among the streams); hints:
    extra compile properties (``INFERENCE_PRECISION_HINT`` for a measurement); width: the sequence
    length of the fixed-length twin (the encoder's full chunk), None for none.
    """
    if not calibration:
        raise InputError("int8 calibration needs at least one chunk of text")
    versions = _versions()
    digest = calibration_hash(calibration)
    attention = export_attention(model)
    folder = Path(cache_root) / "int8" / cache_key(fingerprint, digest, versions, attention)
    units = "+".join(int8_dot_instructions()) or "emulated"  # VNNI / AMX or not: vectors differ (cos 0.995 / 0.985)

    def name(rest):
        return (f"int8 (openvino {versions['openvino']}, nncf {versions['nncf']}, float parts {rest}, {units}, "
                f"recipe {recipe_hash()[:8]}, model {fingerprint[:12]}, calibration {digest[:12]}"
                + (f", {attention} attention" if attention else "") + ")")

    return _load(folder, lambda out: _export_and_quantize(model, calibration, takes_positions, out),
                 compile_properties(threads, streams, hints), width, name)


FLOAT_PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}  # dtype -> OpenVINO's inference precision


def float_model(model, precision: str, cache_root: Path, fingerprint: str, takes_positions: bool, threads: int,
                streams: int = 1, width: int | None = None) -> OpenVinoModel:
    """``model`` exported to OpenVINO unquantized and compiled to run in ``precision`` ("float32" or
    "bfloat16", one of `FLOAT_PRECISIONS`); the export is cached under ``cache_root/openvino/<key>/``
    (key: model fingerprint, OpenVINO, torch and transformers versions; one export serves both precisions). Other
    arguments as for `int8_model`. Raises `InputError` where OpenVINO reports another precision than
    ``precision`` (bf16 on a CPU without bf16 units runs as f32 or emulated in OpenVINO; the encoder
    refuses such a CPU before it gets here, `bf16_units`)."""
    if precision not in FLOAT_PRECISIONS:
        raise InputError(f"OpenVINO float precision must be one of {', '.join(FLOAT_PRECISIONS)}, got {precision!r}")
    versions = _float_versions()
    version = versions["openvino"]
    attention = export_attention(model)
    key = hashlib.sha256(json.dumps({"model": fingerprint, **versions, "export": "float",
                                     **({"attention": attention} if attention else {})},
                                    sort_keys=True).encode()).hexdigest()[:32]
    folder = Path(cache_root) / "openvino" / key
    hint = FLOAT_PRECISIONS[precision]
    compiled = _load(folder, lambda out: _export_float(model, takes_positions, out),
                     compile_properties(threads, streams, {"INFERENCE_PRECISION_HINT": hint}), width,
                     lambda rest: f"{precision} (openvino {version}, runs {rest}, model {fingerprint[:12]}"
                     + (f", {attention} attention" if attention else "") + ")")
    if compiled.runs != hint:
        raise InputError(f"OpenVINO would run {precision} as {compiled.runs} on this CPU (bfloat16 needs "
                         "avx512_bf16 or AMX); use dtype='float32'")
    return compiled
