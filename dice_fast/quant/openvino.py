"""The int8 model: the frozen Hugging Face model exported to OpenVINO and quantized statically by NNCF.

    compiled = int8_model(model, calibration, cache_root, fingerprint, takes_positions, threads, streams, width=256)
    compiled.dynamic, compiled.fixed, compiled.identity   # any shape; length fixed at 256; cache namespace

``calibration`` is a list of (ids, positions) pairs, (1, L) int64 each: wrapped chunks exactly as the
engine runs them. Static quantization fixes every activation scale at calibration, so a chunk's
vector depends on its own tokens only, never on its batch neighbours (dynamic int8 rescales per
batch, which would break the chunk cache's "a vector is a function of its chunk").

The quantized model is cached on disk under ``cache_root/int8/<key>/`` where ``key`` hashes the model
fingerprint (every weight), the calibration set's hash, the recipe and the OpenVINO / NNCF versions:
another model, another calibration or another backend version never hits. A process keeps the
compiled models it loaded, so encoders sharing a model (evaluation twins) compile once.

Why OpenVINO (measured on the 2-core Zen 4 with avx512_vnni, busy machine, see docs/int8.md): static
int8 here ran ~3.3x PyTorch fp32 on 256-token chunks; ONNX Runtime's int8 (dynamic, what
sentence-transformers offers) ran 2.2x at a lower cos min (0.970 against 0.99); PyTorch's own x86
static int8 (PT2E) needs the packed forward exported and compiled, which the eager packed forward
cannot be without the compiled path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError

# NNCF's transformer preset (softmax, LayerNorm and GELU stay in floating point) with SmoothQuant at
# alpha 0.7 on the matmuls (NNCF's default is 0.95). Chosen on text that neither calibration nor the
# held-out agreement uses (benchmarks/int8_recipe.py on benchmarks/data/sample.jsonl; MiniLM, 300
# chunks of 254 tokens each): worst chunk cosine 0.9956 at 0.7 against 0.9874 at 0.95 and 0.988-0.989
# at 0.85-0.9, whose calibration cosines looked best (RESULTS §16). Changing any of these changes the key.
RECIPE = {"backend": "openvino+nncf", "model_type": "transformer", "preset": "mixed", "subset_size": 300,
          "smooth_quant_alpha": 0.7}
_MEMO: dict = {}
_LOCK = threading.Lock()


def _versions() -> dict:
    import nncf
    import openvino as ov

    return {"openvino": ov.__version__.split("-")[0], "nncf": nncf.__version__}


def calibration_hash(calibration) -> str:
    """SHA-256 (hex) of a calibration set: its (ids, positions) arrays, in order."""
    h = hashlib.sha256()
    for ids, pos in calibration:
        h.update(np.asarray(ids, np.int64).tobytes() + b"|" + np.asarray(pos, np.int64).tobytes() + b";")
    return h.hexdigest()


def recipe_hash() -> str:
    """SHA-256 (hex) of `RECIPE`: named in the identity, so the chunk cache never mixes two recipes' vectors."""
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()


def cache_key(fingerprint: str, calibration_digest: str, versions: dict | None = None) -> str:
    """The folder name of one quantized model: (model fingerprint, calibration hash, recipe, versions)."""
    blob = json.dumps({"model": fingerprint, "calibration": calibration_digest, "recipe": RECIPE,
                       **(versions or _versions())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class _Dense(torch.nn.Module):
    """(input_ids, attention_mask[, position_ids]) (B, L) -> last_hidden_state (B, L, H)."""

    def __init__(self, model, takes_positions: bool):
        super().__init__()
        self.model, self.takes_positions = model, takes_positions

    def forward(self, input_ids, attention_mask, position_ids=None):
        kw = {"position_ids": position_ids} if self.takes_positions else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state


def _feed(ids: np.ndarray, pos: np.ndarray, takes_positions: bool) -> dict:
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if takes_positions:
        feed["position_ids"] = pos
    return feed


def _export_and_quantize(model, calibration, takes_positions: bool, out: Path) -> None:
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    from .. import attention as attn

    twin = copy.deepcopy(model).float().eval()  # the caller's model is never touched
    if attn.installed(twin):
        attn.uninstall(twin)
    names = ["input_ids", "attention_mask"] + (["position_ids"] if takes_positions else [])
    ids, pos = (torch.from_numpy(np.repeat(a, 2, axis=0)) for a in calibration[0])
    mask = torch.ones_like(ids)
    mask[1, max(ids.shape[1] // 2, 1):] = 0  # a padded row: an all-ones example lets transformers drop the mask
    example = {"input_ids": ids, "attention_mask": mask}
    if takes_positions:
        example["position_ids"] = pos
    with torch.no_grad():
        fp = ov.convert_model(_Dense(twin, takes_positions), example_input=example,
                              input=[(n, [-1, -1], ov.Type.i64) for n in names])
    data = nncf.Dataset([_feed(i, p, takes_positions) for i, p in calibration])
    smooth = AdvancedSmoothQuantParameters(matmul=RECIPE["smooth_quant_alpha"])
    q = nncf.quantize(fp, data, model_type=nncf.ModelType.TRANSFORMER, preset=nncf.QuantizationPreset.MIXED,
                      subset_size=min(RECIPE["subset_size"], len(calibration)),
                      advanced_parameters=AdvancedQuantizationParameters(smooth_quant_alphas=smooth))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    ov.save_model(q, str(tmp / "model.xml"), compress_to_fp16=False)
    try:
        os.replace(tmp, out)  # atomic: a reader sees a whole model or none
    except OSError:  # another process won the race: its model is the same
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Int8Model:
    """A quantized model compiled for one runner: ``dynamic`` takes (rows, length) of any size;
    ``fixed`` (None without a width) is the same model with the length fixed at ``width`` (rows still
    free): OpenVINO's CPU kernels run a known sequence length ~1.1x faster (RESULTS §16), and full
    chunks, the bulk of a long-document corpus, all have that length. ``identity`` names backend,
    versions, the float parts' precision and the recipe, model and calibration hashes: the chunk
    cache's namespace for these vectors (`encoder.precision`)."""

    dynamic: object
    fixed: object
    width: int | None
    identity: str


def int8_model(model, calibration, cache_root: Path, fingerprint: str, takes_positions: bool, threads: int,
               streams: int = 1, hints: dict | None = None, width: int | None = None) -> Int8Model:
    """``model`` quantized with ``calibration`` and compiled (`Int8Model`).

    model: the float Hugging Face model (read only); calibration: [(ids, positions)] of (1, L) int64,
    at least one; cache_root: folder holding ``int8/<key>/model.xml``; fingerprint: the model's
    (`model_fingerprint`); threads: inference threads; streams: OpenVINO streams (1: one latency
    stream using every thread; more: a throughput model, threads shared among the streams); hints:
    extra compile properties (``INFERENCE_PRECISION_HINT`` for a measurement); width: the sequence
    length of the fixed-length twin (the encoder's full chunk), None for none.
    """
    import openvino as ov

    if not calibration:
        raise InputError("int8 calibration needs at least one chunk of text")
    if width is not None and width < 1:
        raise InputError(f"int8 fixed width must be a positive token count, got {width}")
    versions = _versions()
    digest = calibration_hash(calibration)
    key = cache_key(fingerprint, digest, versions)
    props = {"INFERENCE_NUM_THREADS": int(threads)}
    props.update({"PERFORMANCE_HINT": "LATENCY"} if streams <= 1 else
                 {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": int(streams)})
    props.update(hints or {})
    memo = (key, json.dumps(props, sort_keys=True), width)
    with _LOCK:
        if memo in _MEMO:
            return _MEMO[memo]
        folder = Path(cache_root) / "int8" / key
        if not (folder / "model.xml").is_file():
            folder.parent.mkdir(parents=True, exist_ok=True)
            _export_and_quantize(model, calibration, takes_positions, folder)
        core = ov.Core()
        quantized = core.read_model(str(folder / "model.xml"))
        dynamic = core.compile_model(quantized, "CPU", props)
        fixed = None
        if width is not None:
            twin = quantized.clone()  # the read model, not a second read of the file
            twin.reshape({p.get_any_name(): ov.PartialShape([-1, int(width)]) for p in twin.inputs})
            fixed = core.compile_model(twin, "CPU", props)
        # the float parts' precision is OpenVINO's per-CPU default (bf16 where the CPU has it): named,
        # since it shifts vectors (within the stated agreement)
        rest = dynamic.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # "bf16" / "f32"
        identity = (f"int8 (openvino {versions['openvino']}, nncf {versions['nncf']}, float parts {rest}, "
                    f"recipe {recipe_hash()[:8]}, model {fingerprint[:12]}, calibration {digest[:12]})")
        _MEMO[memo] = Int8Model(dynamic, fixed, width, identity)
        return _MEMO[memo]


def cached_models(cache_root: Path) -> list[str]:
    """Keys of the quantized models stored under ``cache_root`` (for tests and housekeeping)."""
    folder = Path(cache_root) / "int8"
    return sorted(p.name for p in folder.iterdir() if (p / "model.xml").is_file()) if folder.is_dir() else []
