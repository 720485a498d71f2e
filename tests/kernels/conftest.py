"""Kernel tests run the Triton kernels on the CPU under Triton's interpreter (no GPU needed).

The interpreter is chosen when a kernel is decorated, so the variable is set before the kernels'
module is imported (and the module reloaded if something imported it compiled)."""
import importlib
import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

_name = "laneplay.kernels.triton_kernels"
if _name in sys.modules:
    importlib.reload(sys.modules[_name])
