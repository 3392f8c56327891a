"""A sentence-transformers model's modules after its pooling, applied to every chunk vector.

Models such as LaBSE, GTR-T5, sentence-T5 or stella save a projection after the pooling (``2_Dense``:
a linear layer and an activation, sometimes several, sometimes with a residual connection); some a
``LayerNorm`` of the pooled vector, or a ``Normalize`` between such modules. Their embedding of a text
is those modules run on the pooled vector, so DICE's chunk vectors are too: the head runs on each pooled
chunk (and query) vector, before chunk normalisation and aggregation. (A ``Normalize`` that ends the
pipeline is not part of the head: it is the encoder's ``normalize_chunks``.)

    head = load_head([("Dense", "/model/2_Dense"), ("LayerNorm", "/model/3_LayerNorm")], hidden_size=768)
    vectors = head(pooled)   # (n, 768) float32 on any device -> (n, head.out_features) float32 there

``load_head`` gives None for no modules. The modules are read from their folders (``config.json`` and
``model.safetensors`` or ``pytorch_model.bin``) as sentence-transformers saves them; an activation must
be a ``torch.nn`` module class (what sentence-transformers itself loads without ``trust_remote_code``).
The head runs in float32 whatever the model's dtype. Anything it cannot read exactly is a `ModelError`
naming the file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import torch

from .errors import ModelError, one_line

_INPUT = "sentence_embedding"  # the features entry a Dense after the pooling reads and writes
_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"  # sentence-transformers' default when none is saved


class _Module:
    """A module on the pooled vectors: ``in_features`` -> ``out_features``, its tensors placed once per device."""

    kind = ""
    in_features = out_features = 0

    def tensors(self) -> tuple:
        """The module's weights in a fixed order: float32 CPU tensors (None: an absent bias; True: Dense's
        identity residual)."""
        return ()

    def describe(self) -> str:
        """What the chunk cache keys the module by, besides its tensors."""
        return f"{self.kind}|{self.in_features}|{self.out_features}|"

    def _on(self, device) -> tuple:
        placed = self.__dict__.setdefault("_placed", {})  # device -> tensors() there
        if device not in placed:
            placed[device] = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in self.tensors())
        return placed[device]


class Dense(_Module):
    """One ``Dense`` module: ``activation(x @ weight.T + bias)`` (+ ``x``, or ``x @ residual.T``)."""

    kind = "Dense"

    def __init__(self, folder: Path, in_features: int):
        cfg = _config(folder, self.kind)
        self.in_features = in_features
        try:
            self.out_features = int(cfg["out_features"])
            saved_in = int(cfg.get("in_features", in_features))
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{folder / 'config.json'}: a Dense module needs integer in_features and out_features",
                             str(folder)) from None
        _check_width(folder, "in_features", saved_in, in_features)
        self.activation_name = str(cfg.get("activation_function") or _DEFAULT_ACTIVATION)
        self.activation = _activation(self.activation_name, folder)
        weights = _weights(folder, self.kind)
        self.weight = _tensor(weights, "linear.weight", (self.out_features, in_features), folder, self.kind)
        self.bias = _tensor(weights, "linear.bias", (self.out_features,), folder, self.kind) \
            if cfg.get("bias", True) else None
        self.residual = None  # None: none; True: + x; a tensor: + x @ residual.T
        if cfg.get("use_residual", False):
            self.residual = True if in_features == self.out_features else \
                _tensor(weights, "residual.weight", (self.out_features, in_features), folder, self.kind)

    def tensors(self) -> tuple:
        return self.weight, self.bias, self.residual

    def describe(self) -> str:  # (as before other modules joined the head: the cache keys of Dense heads stay)
        return f"{self.in_features}|{self.out_features}|{self.activation_name}|"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, residual = self._on(x.device)
        out = self.activation(torch.nn.functional.linear(x, weight, bias))
        if residual is True:
            out = out + x
        elif residual is not None:
            out = out + torch.nn.functional.linear(x, residual)
        return out

    def __repr__(self) -> str:
        act = self.activation_name.rsplit(".", 1)[-1]
        return f"Dense {self.in_features}->{self.out_features} {act}" + (" +residual" if self.residual is not None else "")


class LayerNorm(_Module):
    """sentence-transformers' ``LayerNorm`` module: ``torch.nn.LayerNorm(dimension)`` (eps 1e-5) of the vector."""

    kind = "LayerNorm"
    EPS = 1e-5  # torch.nn.LayerNorm's default, which sentence-transformers' module keeps

    def __init__(self, folder: Path, in_features: int):
        cfg = _config(folder, self.kind)
        try:
            dimension = int(cfg["dimension"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{folder / 'config.json'}: a LayerNorm module needs an integer dimension",
                             str(folder)) from None
        _check_width(folder, "dimension", dimension, in_features)
        self.in_features = self.out_features = in_features
        weights = _weights(folder, self.kind)
        self.weight, self.bias = (_tensor(weights, f"norm.{name}", (in_features,), folder, self.kind)
                                  for name in ("weight", "bias"))

    def tensors(self) -> tuple:
        return self.weight, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._on(x.device)
        return torch.nn.functional.layer_norm(x, (self.in_features,), weight, bias, self.EPS)

    def __repr__(self) -> str:
        return f"LayerNorm {self.in_features}"


class Normalize(_Module):
    """sentence-transformers' ``Normalize`` where more modules follow it: each vector over its L2 norm
    (``torch.nn.functional.normalize``, eps 1e-12)."""

    kind = "Normalize"

    def __init__(self, folder: Path, in_features: int):
        self.in_features = self.out_features = in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x, p=2.0, dim=1)

    def __repr__(self) -> str:
        return "Normalize"


MODULES = {cls.kind: cls for cls in (Dense, LayerNorm, Normalize)}  # the modules a head can hold, by kind


class ChunkHead:
    """The modules in pipeline order. ``digest``: SHA-256 of their configuration and weights (the chunk
    cache keys vectors by it)."""

    def __init__(self, layers: list[_Module]):
        self.layers = tuple(layers)
        self.out_features = self.layers[-1].out_features
        h = hashlib.sha256()
        for layer in self.layers:
            h.update(layer.describe().encode())
            for t in layer.tensors():
                h.update(t.numpy().tobytes() if isinstance(t, torch.Tensor) else repr(t).encode())
        self.digest = h.hexdigest()

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        """(n, in_features) float32 -> (n, out_features) float32."""
        with torch.inference_mode():
            for layer in self.layers:
                vectors = layer(vectors)
        return vectors

    def __repr__(self) -> str:
        return "[" + ", ".join(map(repr, self.layers)) + "]"


def load_head(modules, hidden_size: int) -> ChunkHead | None:
    """The `ChunkHead` of ``modules``, (kind, folder) pairs in pipeline order (kind: a key of `MODULES`),
    after a pooling of ``hidden_size``-wide vectors; None for none. Weights stay float32 on the CPU until
    first used."""
    layers, width = [], hidden_size
    for kind, folder in modules:
        layers.append(MODULES[kind](Path(folder), width))
        width = layers[-1].out_features
    return ChunkHead(layers) if layers else None


def with_head(run_batch, head: ChunkHead | None):
    """``run_batch`` (PackedBatch -> (n, hidden_size) float32 chunk vectors) followed by ``head``."""
    return run_batch if head is None else (lambda batch: head(run_batch(batch)))


def applies_to_sentence_vector(folder: Path) -> bool:
    """Whether the ``Dense`` saved in ``folder`` reads and writes the pooled vector (not token embeddings);
    True for a configuration it cannot read (`load_head` then names the problem)."""
    try:
        cfg = _config(folder, "Dense")
    except ModelError:
        return True
    return cfg.get("module_input_name", _INPUT) == _INPUT and cfg.get("module_output_name", _INPUT) in (_INPUT, None)


def _config(folder: Path, kind: str) -> dict:
    try:
        with open(folder / "config.json", encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{folder / 'config.json'}: cannot read the {kind} module's configuration "
                         f"({one_line(exc)[:200]})", str(folder)) from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{folder / 'config.json'}: a {kind} module's configuration must be a JSON object", str(folder))
    return cfg


def _check_width(folder: Path, key: str, saved: int, width: int) -> None:
    if saved != width:
        raise ModelError(f"{folder / 'config.json'}: {key} {saved}, but the vectors it follows are {width} wide",
                         str(folder))


def _activation(name: str, folder: Path):
    """An instance of the ``torch.nn`` module class ``name`` ("torch.nn.modules.activation.Tanh")."""
    module, _, cls = name.rpartition(".")
    found = None
    if module == "torch.nn" or module.startswith("torch.nn.modules."):
        try:
            found = getattr(importlib.import_module(module), cls, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise ModelError(f"{folder / 'config.json'}: activation_function {name!r} is not a torch.nn module class; "
                         "dice_fast applies torch.nn activations only", str(folder))
    try:
        return found()
    except TypeError as exc:
        raise ModelError(f"{folder / 'config.json'}: activation_function {name!r} cannot be made without "
                         f"arguments ({one_line(exc)[:200]})", str(folder)) from None


def _weights(folder: Path, kind: str) -> dict:
    """The module's saved tensors (``model.safetensors``, else ``pytorch_model.bin``)."""
    try:
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            return load_file(str(folder / "model.safetensors"), device="cpu")
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file: any reader error names it
        raise ModelError(f"{folder}: cannot read the {kind} module's weights ({one_line(exc)[:200]})",
                         str(folder)) from None
    raise ModelError(f"{folder}: the {kind} module has no model.safetensors or pytorch_model.bin", str(folder))


def _tensor(weights, key: str, shape: tuple, folder: Path, kind: str) -> torch.Tensor:
    t = weights.get(key) if isinstance(weights, dict) else None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point():
        got = "missing" if t is None else (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ModelError(f"{folder}: the {kind} module's {key} must be a floating-point tensor of shape {shape}, "
                         f"got {got}", str(folder))
    return t.detach().to(torch.float32).contiguous()


__all__ = ["ChunkHead", "Dense", "LayerNorm", "MODULES", "Normalize", "load_head", "with_head", "applies_to_sentence_vector"]
