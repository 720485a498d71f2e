"""Delayed Tensor Parallelism (spec §2): the lanes of one model on `world_size` ranks.

Layout: a front process (the caller of `load_engine`) and `world_size` rank processes. Rank r hosts
lanes [r*L/N, (r+1)*L/N): only those lanes' weight slices (read straight from the checkpoint files),
their residual streams and KV heads, and one vocab shard of a replicated head. Every rank runs the
same `LaneModel` code as the single-device engine; only its `comm` differs: a block's partial is
all-reduced asynchronously right after `wo`/`w2` (issue point) and waited for just before the same
block type's residual add `broadcast_delay` layers later (wait point). `wait_now=True` waits at the
issue point instead: the same function with the communication exposed.

Every rank samples the same token from the same gathered logits with the same seeded generators,
so no per-token broadcast is needed; rank 0's "stop now" flag (client gone, stop string) rides on
the per-step gather. The front broadcasts each request to all ranks over pipes, turns rank 0's
token stream into text, and watches the ranks: a rank that dies or raises ends the engine with an
error naming it, and no process is left behind.
"""
from __future__ import annotations

import itertools
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as wait_for

import torch
import torch.distributed as dist
from torch import Tensor

from engine.checkpoint import load_weights, open_checkpoint, resolve_checkpoint
from engine.config import ModelConfig
from engine.engine import Engine, load_checkpoint_tokenizer
from engine.generate import token_steps
from engine.model import LaneModel, rms_norm
from engine.sampling import SamplingParams, sample


class DTPError(RuntimeError):
    """A rank failed or stopped answering; the message names the rank and the reason."""


def lanes_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config every rank runs: Llama models get one lane per rank (standard TP)."""
    if cfg.arch == "llama":
        for name, v in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
            if v % world_size:
                raise ValueError(f"world_size {world_size} does not divide {name} ({v}) of this Llama model")
        return cfg.with_lanes(world_size)
    if cfg.num_lanes % world_size:
        raise ValueError(f"world_size {world_size} must divide the model's {cfg.num_lanes} lanes")
    return cfg


def rank_lanes(cfg: ModelConfig, rank: int, world_size: int) -> range:
    per = cfg.num_lanes // world_size
    return range(rank * per, (rank + 1) * per)


def vocab_rows(cfg: ModelConfig, rank: int, world_size: int) -> range:
    per = math.ceil(cfg.vocab_size / world_size)
    return range(min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size))


# ---- collectives ------------------------------------------------------------------------------

class DistLanes:
    """Cross-lane sums across ranks: local sum of hosted lanes, then an all-reduce across ranks."""

    def __init__(self, wait_now: bool = False, record: bool = False):
        self.wait_now, self.record = wait_now, record
        self.events: list[tuple[str, float, float]] = []  # (kind, start, end): blocked time on this rank

    def _local(self, x: Tensor) -> Tensor:
        # A fresh buffer: the collective writes into it, and x is still needed as this lane's own partial.
        return x.sum(0, keepdim=True) if x.shape[0] > 1 else x.clone()

    def lane_sum(self, x: Tensor) -> Tensor:
        s, t0 = self._local(x), time.perf_counter()
        dist.all_reduce(s)
        if self.record:
            self.events.append(("blocking", t0, time.perf_counter()))
        return s

    def start_lane_sum(self, x: Tensor):
        s, t0 = self._local(x), time.perf_counter()
        work = dist.all_reduce(s, async_op=True)
        if self.wait_now:
            work.wait()
            work = None
        if self.record:
            self.events.append(("issue" if work is not None else "exposed", t0, time.perf_counter()))
        return s, work

    def ready(self, total: Tensor):
        return total, None

    def wait(self, handle) -> Tensor:
        s, work = handle
        if work is not None:
            t0 = time.perf_counter()
            work.wait()
            if self.record:
                self.events.append(("wait", t0, time.perf_counter()))
        return s


class DTPLaneModel(LaneModel):
    """A rank's slice of the model; its head yields this rank's part of the logits."""

    def __init__(self, cfg, weights, lanes, comm, rows: range):
        super().__init__(cfg, weights, lanes, comm)
        self.rows = rows  # this rank's vocab rows (replicate / pre_norm_lane_agg heads)

    @property
    def full_logits(self) -> bool:  # the lane head all-reduces whole-vocabulary logits
        return self.cfg.lm_head_type == "lane"

    def head(self, h: Tensor) -> Tensor:
        """[L_r, B, S, D] -> this rank's vocab shard [B, S, V_r] (or full logits for the lane head)."""
        cfg, comm, eps = self.cfg, self.comm, self.cfg.norm_eps
        if cfg.pre_norm_lane_agg:
            y = rms_norm(comm.lane_sum(h)[0], self.norm, eps)
        elif cfg.lm_head_type == "replicate":  # y = mean over all lanes of Norm(h_l), then the shard rows
            y = comm.lane_sum(rms_norm(h, self.norm, eps))[0] / cfg.num_lanes
        else:
            hn = rms_norm(h, self.norm, eps)
            per_lane = torch.bmm(hn.flatten(1, 2), self.head_weight.transpose(1, 2))  # [L_r, B*S, V or V/L]
            per_lane = per_lane.view(len(self.lanes), *h.shape[1:3], -1)
            if cfg.lm_head_type == "lane":
                return comm.lane_sum(per_lane)[0].float()
            return self.gather_vocab(per_lane).float()  # vocab_parallel: this rank's lanes' slices
        return (y @ self.head_weight.T).float()

    def gather_logits(self, local: Tensor, tail: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """All ranks' vocab shards [..., V_r] -> full logits [..., V] (shards are contiguous, in rank
        order, padded to one size). `tail`: a few floats per rank that ride along, returned [world, t]."""
        if self.full_logits and tail is None:
            return local, None
        tail = local.new_zeros(0) if tail is None else tail
        if self.full_logits:  # already whole on every rank: only the tail needs exchanging
            parts = [torch.empty_like(tail) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, tail)
            return local, torch.stack(parts)
        world, V = dist.get_world_size(), self.cfg.vocab_size
        per = math.ceil(V / world)
        padded = torch.nn.functional.pad(local, (0, per - local.shape[-1]), value=float("-inf"))
        payload = torch.cat([padded.flatten(), tail])
        parts = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(parts, payload)
        table = torch.stack(parts)  # [world, numel + t]
        shards = table[:, :padded.numel()].view(world, *padded.shape)
        full = shards.movedim(0, -2).reshape(*padded.shape[:-1], world * per)[..., :V]
        return full, table[:, padded.numel():]


# ---- one rank -----------------------------------------------------------------------------------

class RankRunner:
    """What runs inside rank r: the model slice, and the runner protocol of `token_steps`."""

    def __init__(self, path, rank: int, world: int, device, dtype, wait_now: bool, record: bool, conn):
        cfg, src = open_checkpoint(path)
        self.cfg = cfg = lanes_config(cfg, world)
        self.rank, self.world, self.device, self.conn = rank, world, torch.device(device), conn
        lanes = rank_lanes(cfg, rank, world)
        rows = vocab_rows(cfg, rank, world)
        sharded_head = cfg.lm_head_type == "replicate"
        try:
            weights = load_weights(cfg, src, lanes, dtype=dtype, device=self.device,
                                   head_rows=rows if sharded_head else None)
        finally:
            src.close()
        self.comm = DistLanes(wait_now=wait_now, record=record)
        self.model = DTPLaneModel(cfg, weights, lanes, self.comm, rows)
        layer_keys = [k for k in weights if k.startswith("layers.")]
        self.layer_bytes = sum(weights[k].numel() * weights[k].element_size() for k in layer_keys)
        self.head_bytes = weights["head"].numel() * weights["head"].element_size()
        self.cache = None
        self.request_id = None
        self.cancelled = False

    def info(self) -> dict:
        return {"lanes": [self.model.lanes.start, self.model.lanes.stop], "layer_bytes": self.layer_bytes,
                "head_bytes": self.head_bytes, "vocab_rows": [self.model.rows.start, self.model.rows.stop],
                "pid": os.getpid()}

    # -- the runner protocol of engine.generate.token_steps --
    @torch.inference_mode()
    def prefill(self, ids: Tensor, n: int, max_seq_len: int) -> Tensor:
        local, self.cache = self.model.prefill(ids, n, max_seq_len)
        return local

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, pos: int) -> Tensor:
        t0 = time.perf_counter()
        out = self.model.decode(tokens, pos, self.cache)
        if self.comm.record:
            self.comm.events.append(("step", t0, time.perf_counter()))
        return out

    @torch.inference_mode()
    def pick(self, local: Tensor, params: SamplingParams, generators) -> Tensor:
        """The per-step gather (spec §2.5): greedy via per-shard top-1, sampling via whole logits.
        Rank 0's stop flag rides along, so all ranks leave the loop at the same step."""
        flag = torch.tensor([1.0 if self.rank == 0 and self._cancel_requested() else 0.0], device=local.device)
        n = local.shape[0]
        if params.greedy and not self.model.full_logits:
            best, idx = local.max(-1)
            payload = torch.cat([best, (idx + self.model.rows.start).float(), flag])
            parts = [torch.empty_like(payload) for _ in range(self.world)]
            dist.all_gather(parts, payload)
            table = torch.stack(parts)  # [world, 2n + 1]
            winner = table[:, :n].argmax(0)  # first maximum: the lowest rank, i.e. the lowest vocab id
            tokens = table[:, n:2 * n].gather(0, winner[None])[0].long()
            flags = table[:, -1]
        else:
            logits, flags = self.model.gather_logits(local, flag)
            tokens = sample(logits, params, generators)
        self.cancelled = bool(flags.sum().item() > 0)
        return tokens

    def _cancel_requested(self) -> bool:
        while self.conn.poll():
            msg = self.conn.recv()
            if msg[0] == "cancel" and msg[1] == self.request_id:
                return True
        return False

    # -- requests --
    def logits(self, ids) -> Tensor:
        with torch.inference_mode():
            local = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), pos=0, cache=None)
            return self.model.gather_logits(local)[0].cpu()

    def generate(self, rid, ids, params: SamplingParams, seeds, eos_ids):
        self.request_id, self.cancelled = rid, False
        self.comm.events.clear()
        try:
            for host, t in token_steps(self, ids, params, eos_ids, seeds, should_stop=lambda: self.cancelled):
                if self.rank == 0:
                    self.conn.send(("tokens", rid, host, t))
        finally:
            self.cache = None
        if self.rank == 0:
            self.conn.send(("done", rid, self.timeline_summary()))

    def timeline_summary(self) -> dict:
        """Where rank 0's decode steps went: whole steps, and the time blocked in collectives inside them
        (waits on delayed all-reduces, immediate "wait now" waits, blocking all-reduces); the rest is compute.
        `events` keeps the raw (kind, start, end) spans of this request."""
        out = {"rank": self.rank, "events": [(k, s, e) for k, s, e in self.comm.events]}
        for kind in ("step", "blocking", "exposed", "issue", "wait"):
            spans = [e - s for k, s, e in self.comm.events if k == kind]
            out[kind] = {"count": len(spans), "ms": 1000 * sum(spans)}
        blocked = sum(out[k]["ms"] for k in ("blocking", "exposed", "wait"))
        out["compute_ms"] = out["step"]["ms"] - blocked if out["step"]["count"] else None
        return out


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the front process dies (no orphaned ranks)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def rank_main(rank: int, world: int, address: str, port: int, device: str, timeout_s: float, threads: int) -> None:
    """A rank process: join the process group, then serve the front's messages until "close"."""
    _die_with_parent()
    torch.set_num_threads(threads)
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("LANEPLAY_DTP_KEY")))
    conn.send(("hello", rank))
    if device.startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    runner = None
    try:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "close":
                break
            if kind == "load":  # (path, dtype name, wait_now, record)
                runner = None
                runner = RankRunner(msg[1], rank, world, device, getattr(torch, msg[2]), msg[3], msg[4], conn)
                conn.send(("ready", rank, runner.info()))
            elif kind == "configure":
                runner.comm.wait_now, runner.comm.record = msg[1], msg[2]
                conn.send(("configured", rank))
            elif kind == "logits":
                out = runner.logits(msg[1])
                if rank == 0:  # numpy pickles by value (torch tensors would go through fd sharing)
                    conn.send(("logits", out.numpy()))
            elif kind == "generate":
                _, rid, ids, params, seeds, eos_ids = msg
                runner.generate(rid, ids, SamplingParams(**params), seeds, set(eos_ids))
            # a "cancel" for a request that already ended needs nothing
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass  # the front went away: leave quietly
    except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
        try:
            conn.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc(limit=8)))
        except Exception:
            pass
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the front ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DTPEngine(Engine):
    """Same surface as the single-process Engine (`logits`, `generate`, `close`), lanes on N ranks."""

    def __init__(self, world_size: int, device: torch.device, timeout_s: float):
        super().__init__(None, None, None, device, None)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.wait_now = self.record_timeline = False
        self.last_timeline: dict | None = None
        self.rank_info: list[dict] = []
        self._ids = itertools.count()
        self._failure: str | None = None
        self.conns, self.procs = [], []
        key = secrets.token_bytes(32)
        self._sockdir = tempfile.mkdtemp(prefix="laneplay-dtp-")
        address = os.path.join(self._sockdir, "front.sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        threads = max(1, (os.cpu_count() or 1) // world_size)
        env = dict(os.environ, LANEPLAY_DTP_KEY=key.hex())
        try:
            port = _free_port()
            for rank in range(world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "engine.dtp", str(rank), str(world_size), address, str(port), str(device),
                     str(timeout_s), str(threads)], env=env, stdin=subprocess.DEVNULL))
            self.conns = self._accept(listener, deadline=time.monotonic() + max(120.0, timeout_s))
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener, deadline: float) -> list:
        """Each rank connects back and says its rank; a rank that dies while starting is an error."""
        accepted: list = []
        thread = threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in self.procs], daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"rank {dead[0]} exited with code {self.procs[dead[0]].returncode}" if dead else "timed out"
                raise DTPError(f"the DTP ranks did not start: {why}")
        conns = [None] * len(self.procs)
        for conn in accepted:
            conns[conn.recv()[1]] = conn
        return conns

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- talking to the ranks --
    def _fail(self, reason: str) -> None:
        self._failure = reason
        self.close()
        raise DTPError(reason)

    def _check_usable(self) -> None:
        if self._failure:
            raise DTPError(f"the DTP engine is not usable: {self._failure}")

    def _send(self, msg, ranks=None) -> None:
        self._check_usable()
        for rank in ranks if ranks is not None else range(self.world_size):
            try:
                self.conns[rank].send(msg)
            except (BrokenPipeError, OSError):
                self._fail(f"rank {rank} is gone (exit code {self.procs[rank].poll()})")

    def _recv(self, any_rank: bool = False, timeout: float | None = None):
        """The next message from rank 0 (or any rank); a dead or failing rank raises DTPError."""
        timeout = timeout if timeout is not None else self.timeout_s + 30
        deadline = time.monotonic() + timeout
        rank_of = {c: r for r, c in enumerate(self.conns)}
        while True:
            ready = wait_for(list(rank_of), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for conn in ready:
                r = rank_of[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    try:
                        self.procs[r].wait(5)
                    except subprocess.TimeoutExpired:
                        pass
                    self._fail(f"rank {r} died (exit code {self.procs[r].poll()})")
                if msg[0] == "error":
                    self._fail(self._root_cause() + f"rank {msg[1]} failed: {msg[2]}\n{msg[3]}")
                if any_rank or r == 0:
                    return msg
            for r, p in enumerate(self.procs):  # a rank killed without closing its socket
                if p.poll() is not None:
                    self._fail(f"rank {r} died (exit code {p.returncode})")
            if time.monotonic() > deadline:
                self._fail(f"no answer from the ranks within {timeout:.0f} s")

    def _root_cause(self) -> str:
        """When a rank reports a broken collective, the usual cause is a peer that died: name it."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None and p.returncode != 1]
            if dead:
                return "".join(f"rank {r} died (exit code {code}); " for r, code in dead)
            time.sleep(0.05)
        return ""

    def _gather_replies(self, kind: str, timeout: float) -> list:
        replies = [None] * self.world_size
        for _ in range(self.world_size):
            msg = self._recv(any_rank=True, timeout=timeout)
            if msg[0] != kind:
                self._fail(f"rank {msg[1]} answered {msg[0]!r} where {kind!r} was expected")
            replies[msg[1]] = msg[2] if len(msg) > 2 else None
        return replies

    # -- loading and settings --
    def load(self, model, dtype: torch.dtype) -> None:
        """(Re)load a checkpoint into the running ranks; each reads only its own lanes' slices."""
        path = resolve_checkpoint(model)
        cfg, src = open_checkpoint(path)
        try:
            cfg = lanes_config(cfg, self.world_size)
            tokenizer = load_checkpoint_tokenizer(path, src)
        finally:
            src.close()
        self._send(("load", str(path), str(dtype).removeprefix("torch."), self.wait_now, self.record_timeline))
        self.rank_info = self._gather_replies("ready", timeout=max(300.0, self.timeout_s))
        self.cfg, self.path, self.dtype, self._tokenizer = cfg, path, dtype, tokenizer
        self.__dict__.pop("eos_ids", None)

    def configure(self, wait_now: bool | None = None, timeline: bool | None = None) -> None:
        """Switch between delayed and "wait now" collectives, and the per-rank timeline, between requests."""
        self.wait_now = self.wait_now if wait_now is None else bool(wait_now)
        self.record_timeline = self.record_timeline if timeline is None else bool(timeline)
        self._send(("configure", self.wait_now, self.record_timeline))
        self._gather_replies("configured", timeout=self.timeout_s)

    # -- the engine surface --
    def _full_forward(self, ids: Tensor) -> Tensor:
        self._send(("logits", ids.tolist()))
        return torch.from_numpy(self._recv()[1])

    def _token_steps(self, ids, params, seeds, should_stop):
        """Rank 0's (tokens, time) stream for one request; stopping early cancels it on all ranks."""
        rid = next(self._ids)
        self._send(("generate", rid, ids, asdict(params), seeds, sorted(self.eos_ids)))
        cancel_sent = finished = False
        try:
            while True:
                if should_stop is not None and not cancel_sent and should_stop():
                    self._send(("cancel", rid), ranks=[0])
                    cancel_sent = True
                msg = self._recv()
                if msg[0] == "done" and msg[1] == rid:
                    self.last_timeline, finished = msg[2], True
                    return
                if msg[0] == "tokens" and msg[1] == rid:
                    yield msg[2], msg[3]
        finally:
            if not finished and not self._failure:  # the consumer stopped early: stop the ranks too
                if not cancel_sent:
                    self._send(("cancel", rid), ranks=[0])
                while (msg := self._recv())[:2] != ("done", rid):
                    pass
                self.last_timeline = msg[2]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close",))
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for c in self.conns:
            if c is not None:
                c.close()
        self.conns, self.procs = [], []
        shutil.rmtree(getattr(self, "_sockdir", ""), ignore_errors=True)
        if not self._failure:
            self._failure = "the engine was closed"


def load_dtp_engine(model, device, dtype, world_size: int, wait_now: bool = False, timeline: bool = False,
                    timeout_s: float = 60.0) -> DTPEngine:
    """Start `world_size` rank processes and load the checkpoint into them."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size {world_size} needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    cfg, src = open_checkpoint(resolve_checkpoint(model))  # fail on a bad checkpoint before starting ranks
    src.close()
    lanes_config(cfg, world_size)
    engine = DTPEngine(world_size, device, timeout_s)
    try:
        engine.wait_now, engine.record_timeline = wait_now, timeline
        engine.load(model, dtype)
    except BaseException:
        engine.close()
        raise
    return engine


if __name__ == "__main__":  # a rank process, started by DTPEngine
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]),
              int(sys.argv[7]))
