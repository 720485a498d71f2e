"""The engine behind the app: a local `laneplay engine` process that is started, watched and restarted,
or a running OpenAI-compatible server given by URL (our engine on a GPU node, vLLM, llama.cpp, ...).

Both answer the same questions for the UI: what is the engine doing (`state`: loading, compiling,
warming up, ready, restarting, unreachable, failed), where is it (`url`), and what runs there
(`info`: model, device, world size, whether it sends our timing).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque

from laneplay import protocol
from laneplay.api_client import EngineError, SyncEngineClient, api_base
from laneplay.processes import die_with_parent, free_port

READY = "ready"


def world_sizes(model_config: dict | None, most: int = 8) -> list[int] | None:
    """The DTP world sizes above 1 (up to `most`) that split the served model, from its /health
    `model_config`: a Llama model's attention heads, key-value heads and MLP width must divide by the size
    (one lane per rank), a Laneformer's lanes. None: the engine did not say its shapes."""
    c = model_config if isinstance(model_config, dict) else {}
    parts = ([c.get("num_heads"), c.get("num_kv_heads"), c.get("intermediate_size")] if c.get("arch") == "llama"
             else [c.get("num_lanes")])
    if not c or not all(isinstance(p, int) and p > 0 for p in parts):
        return None
    return [w for w in range(2, most + 1) if all(p % w == 0 for p in parts)]


def health_info(h: dict) -> dict:
    """What the UI keeps of our engine's /health: where and what runs, its context, the model's shapes."""
    return {"model": h.get("model"), "device": h.get("device"), "dtype": h.get("dtype"),
            "world_size": h.get("world_size", 1), "context_length": h.get("context_length"),
            "model_config": h.get("model_config") if isinstance(h.get("model_config"), dict) else None,
            "laneplay": True}


class Engine:
    """What the UI needs of an engine; subclasses fill `state`, `detail` and `info`."""

    def __init__(self):
        self.state, self.detail = "loading", "starting the engine"
        self.info: dict = {}
        self.url: str = ""
        self.api_key: str | None = None
        self.restarts = 0
        self.pid: int | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def _set(self, state: str, detail: str = "") -> None:
        with self._changed:
            self.state, self.detail = state, detail
            self._changed.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.state != READY:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))
        return True

    def status(self) -> dict:
        return {"state": self.state, "detail": self.detail, "url": self.url, "pid": self.pid,
                "restarts": self.restarts, **self.info}

    def start(self) -> None: ...

    def stop(self) -> None: ...


class LocalEngine(Engine):
    """Runs `laneplay engine` on a free loopback port and keeps it running: when the process dies the
    state says so, and it is started again after a backoff (1 s, 2 s, 4 s ... at most 30 s)."""

    def __init__(self, model: str, device: str = "cpu", dtype: str = "auto", world_size: int | str = 1,
                 compile: bool = True, extra_args: list[str] | None = None):
        """`world_size` "auto": the engine starts at 1, and once it says its model's shapes it is started
        again at the smallest world size above 1 that splits the model (it stays at 1 when none does)."""
        super().__init__()
        self.model, self.device, self.dtype = model, device, dtype
        self.auto = world_size == "auto"
        self.world_size = 1 if self.auto else int(world_size)
        self.compile, self.extra_args = compile, list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=200)  # the engine's last lines of output, for error messages
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "laneplay", "engine", "--model", self.model, "--device", self.device,
               "--dtype", self.dtype, "--world-size", str(self.world_size), "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", *self.extra_args]
        if not self.compile:
            cmd.append("--no-compile")
        env = dict(os.environ, LANEPLAY_API_KEY="")  # loopback only; the app is the one client
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)  # the engine ends with the app
        self.pid = self.proc.pid
        threading.Thread(target=self._read_output, args=(self.proc,), daemon=True).start()

    def _read_output(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.rstrip()
            self.log.append(line)
            stage = protocol.parse_stage(line)
            if stage in protocol.STAGES and self.state != READY:
                if self.restarts:  # after a crash the state stays "restarting" until it is back
                    self._set("restarting", f"restart {self.restarts}: {stage} {self.model}")
                else:
                    self._set(stage, f"{stage} {self.model}")  # the state is named as the stage

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping:
            self._spawn()
            if self.restarts:
                self._set("restarting", f"engine restarted ({self.restarts}); loading {self.model}")
            healthy_since = None
            while not self._stopping and self.proc.poll() is None:
                if not self.ready:
                    info = self._probe()
                    if info is not None and self._resize(info):
                        break  # started again below at the size that splits the model
                    if info is not None:
                        self.info = info
                        self._set(READY, f"{info.get('model', self.model)} on {info.get('device', self.device)}")
                        healthy_since = time.monotonic()
                elif healthy_since and time.monotonic() - healthy_since > 60:
                    backoff = 1.0  # it stayed up: the next crash restarts quickly again
                time.sleep(0.25 if not self.ready else 0.5)
            if self._stopping:
                break
            if self.proc.poll() is None:  # a resize: not a crash
                self._end_process()
                continue
            code = self.proc.returncode
            tail = next((ln for ln in reversed(self.log) if ln and protocol.parse_stage(ln) is None), "")
            self.restarts += 1
            self._set("restarting", f"the engine process exited (code {code}){': ' + tail[-200:] if tail else ''}; "
                                    f"restarting in {backoff:.0f} s")
            deadline = time.monotonic() + backoff
            while not self._stopping and time.monotonic() < deadline:
                time.sleep(0.1)
            backoff = min(backoff * 2, 30.0)

    def _resize(self, info: dict) -> bool:
        """With world size auto, the first time the engine answers: pick the size (see __init__); True when
        the engine must be started again at it."""
        if not self.auto:
            return False
        self.auto = False
        sizes = world_sizes(info.get("model_config"))
        if not sizes:
            self.log.append(f"world size auto: no size from 2 to 8 splits {info.get('model')}; staying at 1")
            return False
        self.world_size = sizes[0]
        self._set("loading", f"world size auto: {sizes[0]} splits {info.get('model')}; starting {sizes[0]} DTP ranks")
        return True

    def _probe(self) -> dict | None:
        """Our engine's health once it answers; None before, and while some other process answers on the
        port (it was free when chosen, and the engine binds it only once its model is loaded: a server that
        took it meanwhile is not ours, and our engine, failing to bind, exits and starts on another)."""
        try:
            with SyncEngineClient(self.url, timeout_s=1.0, connect_s=1.0) as client:
                h = client.health()
        except EngineError:
            return None
        if h is None or h.get("pid") != self.proc.pid:
            return None
        return health_info(h)

    def status(self) -> dict:
        out = super().status()
        if not self.ready:  # what the engine said last, for the operator
            out["log_tail"] = [ln for ln in list(self.log)[-5:]]
        return out

    def _end_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def stop(self) -> None:
        self._stopping = True
        self._end_process()
        self._set("stopped", "the engine was stopped")


class RemoteEngine(Engine):
    """An engine someone else runs: polled every few seconds; any OpenAI-compatible server works."""

    def __init__(self, url: str, api_key: str | None = None):
        super().__init__()
        self.url = api_base(url)
        self.api_key = api_key
        self.state, self.detail = "loading", f"connecting to {self.url}"
        self._stopping = False

    def start(self) -> None:
        threading.Thread(target=self._poll, name="engine-poller", daemon=True).start()

    def _poll(self) -> None:
        client = SyncEngineClient(self.url, api_key=self.api_key, timeout_s=3.0, connect_s=3.0)
        while not self._stopping:
            info = None
            try:
                h = client.health()
                if h is not None and h["laneplay"]:
                    info = health_info(h)
                else:  # another OpenAI-compatible server: its model list is the health check
                    data = client.models() or [{}]
                    info = {"model": data[0].get("id"), "device": "remote", "world_size": None,
                            "context_length": None, "laneplay": False}
            except EngineError as e:
                self._set("unreachable", f"{self.url} answered {e.status} to /v1/models" if e.status
                          else f"{self.url} is not reachable ({e.cause or e.message})")
            if info is not None:
                self.info = info
                if not self.ready:
                    self._set(READY, f"{info.get('model')} at {self.url}")
            time.sleep(1.0 if not self.ready else 3.0)

    def stop(self) -> None:
        self._stopping = True
