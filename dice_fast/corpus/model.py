"""Loading the job's model with every foreseeable failure (missing or wrong folder, a hub name with no
network or cache, CUDA unavailable) turned into one readable line."""

from __future__ import annotations



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
    return make_encoder(args)  # a bad --model raises dice_fast.errors.ModelError, as in every subcommand
