"""Suite-wide settings: offline, deterministic, and Triton kernels through the interpreter on CPU."""
import os
from pathlib import Path

# Must be set before any module defining @triton.jit kernels is imported.
if not os.environ.get("LANEPLAY_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.environ.get("PYTEST_XDIST_WORKER") and "LANEPLAY_HF_GGUF_CACHE" not in os.environ:
    # transformers' conversion of the embedded GGUF, made once for the run: the workers and the bench
    # subprocesses inherit this folder (bench/common.py:hf_from_gguf); removed when the run ends
    import atexit
    import shutil
    import tempfile

    os.environ["LANEPLAY_HF_GGUF_CACHE"] = tempfile.mkdtemp(prefix="laneplay-hf-gguf-")
    atexit.register(shutil.rmtree, os.environ["LANEPLAY_HF_GGUF_CACHE"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread per xdist worker (the workers share the cores; OpenMP threads that spin on a shared core
# slow everyone), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
BROWSER = Path(__file__).resolve().parent / "browser"


def pytest_collection_modifyitems(config, items):
    # The browser tests last: they share one browser for the run (tests/browser/conftest.py), and while
    # it is up Playwright's sync API keeps an event loop running in the main thread.
    items.sort(key=lambda item: Path(item.path).resolve().is_relative_to(BROWSER))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
