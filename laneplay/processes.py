"""Process helpers that the app, the engine and the benchmarks share: a free loopback port, and a child
process that dies with its parent.

Like limits.py it lives beside the packages and imports nothing of ours, so any layer may use it.
"""
from __future__ import annotations

import signal
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: ask the kernel to send `sig` to this process when its parent dies, however it dies (no
    orphaned engines or ranks). Call it in the child (e.g. as a Popen `preexec_fn`); elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux / no libc: nothing to ask for
        pass
