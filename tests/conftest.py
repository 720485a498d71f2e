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
TESTS = Path(__file__).resolve().parent
BROWSER = TESTS / "browser"


def _lowbit_kernels() -> list[str]:
    """The low-bit product kernels this CPU can run (cpuid); "generic" where the extension is not built."""
    from laneplay.kernels import lowbit

    return list(lowbit.kernels()) if lowbit.available() else ["generic"]


@pytest.fixture(params=_lowbit_kernels())
def kernel(request):
    """Each low-bit kernel this CPU offers in turn (`lowbit.use_kernel`), the chosen one restored after."""
    from laneplay.kernels import lowbit

    before = lowbit.kernel_name()
    lowbit.use_kernel(request.param)
    yield request.param
    lowbit.use_kernel(before)


# The longest files first: `make test` hands whole files to its workers in this order, so the long ones
# start at once and the short ones fill in around them (no long file left to start at the end).
LONG_FILES = ("engine/test_dtp.py", "engine/test_model.py", "engine/test_generate.py", "engine/test_batching.py",
              "engine/test_server.py", "bench/test_bench_quick.py", "engine/test_speculative.py", "test_packaging.py",
              "kernels/test_static_step.py", "kernels/test_kernels.py", "app/test_jobs.py", "app/test_ownership.py",
              "engine/test_lowbit_engine.py", "bench/test_bench_spec.py", "engine/test_per_sample.py")


def _order(item) -> tuple[bool, int]:
    path = Path(item.path).resolve()
    name = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
    return path.is_relative_to(BROWSER), LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)


def pytest_collection_modifyitems(config, items):
    # The browser tests last: they share one browser for the run (tests/browser/conftest.py), and while
    # it is up Playwright's sync API keeps an event loop running in the main thread.
    items.sort(key=_order)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
