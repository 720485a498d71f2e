"""The compiled Triton kernels on a CUDA GPU (skipped without one: the interpreter tests in
tests/kernels cover their logic on CPU, and `bench/gpu_check.py` measures them where a GPU exists)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here); "
                    "tests/kernels run every kernel under TRITON_INTERPRET=1 instead")
def test_compiled_kernels_match_their_references(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--kernels-only",
                          "--out", str(tmp_path / "gpu.json")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
