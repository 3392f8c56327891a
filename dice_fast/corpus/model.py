"""Loading the job's model with every foreseeable failure (missing or wrong folder, a hub name with no
network or cache, CUDA unavailable) turned into one readable line."""

from __future__ import annotations

import os
from pathlib import Path


def load_encoder(args):
    """`make_encoder(args)` with the foreseeable failures (missing folder, unreachable hub, no CUDA)
    turned into ValueError with one readable line."""
    from ..cliargs import make_encoder

    device = args.device
    if device is not None and str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available (torch {torch.__version__}); use --device cpu")
        index = str(device).partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    model = args.model
    hub = False
    if model is not None:
        p = Path(model).expanduser()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ValueError(f"--model {model} is not a model folder (it has no config.json)")
        elif p.exists():
            raise ValueError(f"--model {model} is a file; give the model's folder")
        elif model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model:
            raise ValueError(f"--model {model}: no such model folder")
        else:
            hub = True
    try:
        return make_encoder(args)
    except OSError as exc:
        if hub:
            raise ValueError(f"--model {model} is not a local folder and could not be loaded from the Hugging Face "
                             f"Hub or its cache (offline or unknown name: {' '.join(str(exc).split())[:200]}); "
                             "give a local model folder") from None
        raise ValueError(f"cannot load model {model!r} from its folder: {exc}") from None
