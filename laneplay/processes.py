"""Process helpers that the app, the engine and the benchmarks share: a free loopback port, a child
process that dies with its parent, and a call run in a thread of its own.

Like limits.py it lives beside the packages and imports nothing of ours, so any layer may use it.
"""
from __future__ import annotations

import signal
import socket
import threading


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


def in_own_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a new thread that ends with it: its result, or its exception raised here.

    For torch work that must not leave an OpenMP thread pool behind in the calling thread. Each thread
    that runs a parallel torch op gets a libgomp pool of its own, and with two pools on the machine
    libgomp counts itself oversubscribed and puts its waiting threads to sleep after every parallel
    region. A server that loads its model in the main thread and runs it in a worker then pays a
    wake-up per op: a 128-token prompt chunk of the default model took 385-480 ms there against
    290-310 ms when the loading thread had ended (2 cores). Start no child process that dies with its
    parent (`die_with_parent`) in it: the kernel ties that to the thread that started the child, so
    the child would die when this call returns.
    """
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
    t = threading.Thread(target=run, name=getattr(fn, "__name__", "call"))
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
