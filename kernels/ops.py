"""One dispatcher per decode-step kernel: Triton on CUDA, the plain-torch reference elsewhere.

`impl` picks explicitly ("triton" runs the Triton kernel on any tensors, which on CPU means under
`TRITON_INTERPRET=1`, as the tests do; "torch" the reference); by default the tensors' device decides.
The Triton module is imported only when first used, so the CPU engine never loads Triton.
"""
from __future__ import annotations

import functools
import importlib

from torch import Tensor

from laneplay.kernels import reference

IMPLS = ("triton", "torch")


@functools.cache
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def triton_module():
    """The Triton kernels (looked up at call time, so a test can reload them under the interpreter)."""
    return importlib.import_module("laneplay.kernels.triton_kernels")


def choose(t: Tensor, impl: str | None) -> str:
    if impl is None:
        return "triton" if t.is_cuda and triton_available() else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return impl


def _impl(name: str, t: Tensor, impl: str | None):
    return getattr(triton_module() if choose(t, impl) == "triton" else reference, name)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype=None, *, impl: str | None = None) -> Tensor:
    return _impl("rms_norm", x, impl)(x, weight, eps, out_dtype)


# pos: one position for every row, or one per row (separate requests in one step); cache_rows (b, c): row
# lane * b + i uses cache row lane * c + i of a pool of c rows per lane (the CUDA step's batch buckets), or
# an integer tensor gives each row its cache row (several rows may share one: a verify's positions, each
# row seeing the keys the rows before it write; `rope_attention` then runs as the two kernels)

def rope_kv_write(qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, *,
                  impl: str | None = None, cache_rows=None) -> Tensor:
    return _impl("rope_kv_write", qkv, impl)(qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads,
                                             head_dim, cache_rows)


def decode_attention(q, k_cache, v_cache, pos, window, *, impl: str | None = None, config=None,
                     cache_rows=None) -> Tensor:
    """config: the Triton kernel's (split length, keys per block, warps), measured by the CUDA step."""
    if choose(q, impl) == "triton":
        return triton_module().decode_attention(q, k_cache, v_cache, pos, window, config, cache_rows)
    return reference.decode_attention(q, k_cache, v_cache, pos, window, cache_rows)


def rope_attention(qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, window, *,
                   impl: str | None = None, config=None, cache_rows=None) -> Tensor:
    """`rope_kv_write` + `decode_attention` fused (one kernel and the merge on Triton)."""
    args = (qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, window)
    if choose(qkv, impl) == "triton":
        return triton_module().rope_attention(*args, config, cache_rows)
    return reference.rope_attention(*args, cache_rows)


def swiglu(gate_up: Tensor, *, impl: str | None = None) -> Tensor:
    return _impl("swiglu", gate_up, impl)(gate_up)


def residual_update(h, x, *, impl: str | None = None, **kw):
    return _impl("residual_update", h, impl)(h, x, **kw)


def lane_gemv(x: Tensor, w: Tensor, *, impl: str | None = None, config=None) -> Tensor:
    """The lane linear at small batch: "torch" is cuBLAS's batched GEMM on CUDA; "triton" the lane GEMV
    with a block config (the CUDA step measures both per weight shape and keeps the faster)."""
    if choose(x, impl) == "triton":
        mod = triton_module()
        return mod.lane_gemv(x, w, config) if config else mod.lane_gemv(x, w)
    return reference.lane_gemv(x, w)
