"""The peers' side of benchmarks/bench_peers.py; runs in the peers' virtual environment (peers_env.sh).

    $DICE_PEERS_VENV/bin/python benchmarks/peers_worker.py --model DIR --work DIR --texts FILE.json

Exports every peer OFFLINE from the bundled model folder (copied into --work, never written to in
place, never a hub): sentence-transformers with PyTorch fp32, ONNX Runtime fp32, ONNX Runtime
dynamic int8 (--onnx-int8-configs: sentence-transformers' "avx512_vnni" config, and "avx2" beside it on a
CPU without VNNI, as the driver picks from dice_fast's reading of the CPU flags: the config a user of
that CPU is told to pick, and the one measured faster there, RESULTS §18.5), OpenVINO (its default
inference precision) and OpenVINO static int8
(NNCF via optimum-intel, calibrated on the texts' "calibration" list: the first half of the bundled
prose). Then answers the driver on stdin, one line per request: "NAME [N]" -> that peer encodes the
texts (the first N) once and writes its vectors to --work/NAME.npy; "each NAME FILE" -> it encodes the
texts of the JSON list in FILE one call each (benchmarks/bench_latency.py), writes their vectors to
--work/NAME.npy and replies every call's seconds; "quit" ends. Replies are stdout lines
starting with "@@ " (JSON), so library chatter on stdout is ignored by the driver.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np


def onnx_int8_peer(config: str) -> str:
    """The peer name of ONNX Runtime's dynamic int8 in sentence-transformers' export ``config``."""
    return "st_onnx_int8_dynamic" if config == "avx512_vnni" else f"st_onnx_int8_dynamic_{config}"


def say(**msg) -> None:
    print("@@ " + json.dumps(msg), flush=True)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("torch", "transformers", "sentence-transformers", "optimum", "optimum-intel", "optimum-onnx",
              "onnxruntime", "openvino", "nncf"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


def _ov_static_int8(folder: Path, calibration: list[str]) -> None:
    """OpenVINO static int8 of the OpenVINO export in ``folder``, calibrated on ``calibration`` texts
    (what sentence-transformers' export_static_quantized_openvino_model does, with our own texts
    instead of a hub dataset): folder/openvino/openvino_model_qint8_quantized.xml."""
    import datasets
    from optimum.intel.openvino import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), backend="openvino", device="cpu")
    qc = OVQuantizationConfig(num_samples=len(calibration))
    quantizer = OVQuantizer.from_pretrained(st.transformers_model)
    enc = st.tokenizer(calibration, padding="max_length", max_length=st.max_seq_length, truncation=True)
    ds = datasets.Dataset.from_dict({k: list(v) for k, v in enc.items()})
    tmp = folder / "ov_int8_tmp"
    quantizer.quantize(ds, save_directory=str(tmp), ov_config=OVConfig(quantization_config=qc))
    saved = tmp / "openvino" if (tmp / "openvino" / "openvino_model.xml").exists() else tmp  # optimum-intel 1.27: openvino/
    for ext in (".xml", ".bin"):
        shutil.move(str(saved / f"openvino_model{ext}"), str(folder / "openvino" / f"openvino_model_qint8_quantized{ext}"))
    shutil.rmtree(tmp, ignore_errors=True)


def load_peers(model_dir: Path, work: Path, calibration: list[str], onnx_int8_configs: list[str]) -> tuple[dict, dict]:
    """(name -> SentenceTransformer, name -> why skipped). Exports land in work/export (cached there)."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    folder = work / "export"
    if not folder.exists():
        shutil.copytree(model_dir, folder)
    models, skipped = {}, {}

    def attempt(name, fn):
        try:
            t0 = time.perf_counter()
            models[name] = fn()
            say(event="loaded", name=name, seconds=round(time.perf_counter() - t0, 1))
        except Exception as exc:  # a peer that cannot be built is reported, the others still run
            skipped[name] = f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc(file=sys.stderr)

    attempt("st_torch_fp32", lambda: SentenceTransformer(str(folder), device="cpu"))

    def exported(backend: str, marker: str):
        """The peer for ``backend``, exported into the folder once (``marker``: the file it writes)."""
        def build():
            if not (folder / marker).exists():
                SentenceTransformer(str(folder), backend=backend, device="cpu").save_pretrained(str(folder))
            return SentenceTransformer(str(folder), backend=backend, device="cpu")
        return build

    attempt("st_onnx_fp32", exported("onnx", "onnx/model.onnx"))

    def onnx_int8(config: str):
        pattern = f"model_q*int8_{config}.onnx"  # by weight type: model_qint8_avx512_vnni, model_quint8_avx2
        if not any((folder / "onnx").glob(pattern)):
            export_dynamic_quantized_onnx_model(models["st_onnx_fp32"], config, str(folder))
        name = str(next((folder / "onnx").glob(pattern)).relative_to(folder))
        return SentenceTransformer(str(folder), backend="onnx", device="cpu", model_kwargs={"file_name": name})

    for config in onnx_int8_configs:
        attempt(onnx_int8_peer(config), lambda config=config: onnx_int8(config))

    attempt("st_openvino", exported("openvino", "openvino/openvino_model.xml"))

    def ov_int8():
        if not (folder / "openvino" / "openvino_model_qint8_quantized.xml").exists():
            _ov_static_int8(folder, calibration)
        return SentenceTransformer(str(folder), backend="openvino", device="cpu",
                                   model_kwargs={"file_name": "openvino/openvino_model_qint8_quantized.xml"})

    attempt("st_openvino_int8_static", ov_int8)
    return models, skipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--texts", required=True, type=Path, help='JSON {"texts": [...], "calibration": [...]}')
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--onnx-int8-configs", nargs="+", default=["avx512_vnni"], choices=("avx512_vnni", "avx512", "avx2", "arm64"),
                    help="sentence-transformers' dynamic int8 export configs: one ONNX Runtime int8 peer each")
    args = ap.parse_args()
    data = json.loads(args.texts.read_text(encoding="utf-8"))
    texts = data["texts"]
    models, skipped = load_peers(args.model, args.work, data["calibration"], args.onnx_int8_configs)
    say(event="ready", peers=list(models), skipped=skipped, versions=_versions())
    for line in sys.stdin:
        name, _, count = line.strip().partition(" ")  # "NAME [N]": encode the first N texts (a warm-up)
        if name == "quit":
            break
        each_call = name == "each"  # "each NAME FILE": one call per text of FILE, each timed
        if each_call:
            name, _, file = count.partition(" ")
        if name not in models:
            say(event="error", name=name, error="unknown or skipped peer")
            continue
        if each_call:
            vecs, each = [], []
            for text in json.loads(Path(file).read_text(encoding="utf-8")):
                t0 = time.perf_counter()
                out = models[name].encode([text], batch_size=args.batch_size, convert_to_numpy=True)
                each.append(time.perf_counter() - t0)
                vecs.append(out[0])
            np.save(args.work / f"{name}.npy", np.asarray(vecs, np.float32))
            say(event="ran", name=name, seconds=each)
            continue
        t0 = time.perf_counter()
        vecs = models[name].encode(texts[: int(count or len(texts))], batch_size=args.batch_size,
                                   convert_to_numpy=True)
        seconds = time.perf_counter() - t0
        np.save(args.work / f"{name}.npy", np.asarray(vecs, np.float32))
        say(event="ran", name=name, seconds=seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
