"""Delayed Tensor Parallelism (docs/laneformer.md §9): the lanes of one model on `world_size` ranks.

Layout: a front process (the caller of `load_engine`) and `world_size` rank processes. Rank r hosts
lanes [r*L/N, (r+1)*L/N): only those lanes' weight slices (read straight from the checkpoint files),
their residual streams and KV heads, and one vocab shard of a replicated head. Every rank runs the
same `LaneModel` code as the single-device engine; only its `comm` differs: a block's partial is
all-reduced asynchronously right after `wo`/`w2` (issue point) and waited for just before the same
block type's residual add `broadcast_delay` layers later (wait point). `wait_now=True` waits at the
issue point instead: the same function with the communication exposed.

Every rank samples the same token from the same gathered logits with the same seeded generators,
so no per-token broadcast is needed. The front sends each request to all ranks over pipes, turns rank
0's token stream into text, and watches the ranks: a rank that dies or raises ends the engine with an
error naming it, and no process is left behind. Requests run as rows of one batch on every rank
(`Rank.serve`: `engine.batch`'s steps, prompt chunks and shared decode steps; with the static step,
its shared cache); rank 0's word to the others (how many of the front's messages it has taken: joins,
cancels) rides on the per-step gather, and every rank applies the same messages at the same step
boundary.

With the timeline on, every rank records where its decode steps went (compute, collectives issued,
delayed waits, "wait now" waits, blocking collectives); at the end of a request the ranks gather
their per-step summaries (`summarize_timeline`) to rank 0, whose "done" carries them to the front
(`DTPRunner.last_timeline`). `DTPRunner.request_settings` sets both for one request only.
"""
from __future__ import annotations

import bisect
import itertools
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as wait_for

import torch
import torch.distributed as dist
from torch import Tensor

from laneplay.engine.batch import Sequence, decode_step, prompt_turns
from laneplay.engine.checkpoint import load_weights, open_checkpoint
from laneplay.engine.config import ModelConfig
from laneplay.engine.model import LaneModel
from laneplay.engine.runner import LocalRunner
from laneplay.engine.runtime import Runtime
from laneplay.engine.sampling import RowSampler, SamplingParams
from laneplay.processes import die_with_parent, free_port


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
    """Cross-lane sums across ranks (local sum of the hosted lanes, then an all-reduce), and the
    gathers that turn the ranks' head outputs into tokens. The model a rank runs is the plain
    `LaneModel` on its slice of the lanes; everything distributed lives here."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int, rows: range, wait_now: bool = False,
                 record: bool = False, signal=lambda: 0):
        self.cfg, self.rank, self.world, self.rows = cfg, rank, world, rows  # rows: this rank's vocab shard
        self.device = torch.device("cpu")  # where flags live for the collective (the rank's device, set by Rank)
        self.wait_now, self.record = wait_now, record
        # rank 0's word to the others, riding on every per-step gather (`Rank` sets it): how many of the
        # front's messages rank 0 has taken (the others take as many at the next step boundary)
        self.signal = signal
        self.stopped = False  # agree_stop's answer, the same on every rank
        self.news = 0  # rank 0's messages taken since the last step boundary, as every rank heard it
        self.gathers = 0  # per-step gathers so far (a step boundary without one asks with `exchange_news`)
        self.events: list[tuple[str, float, float]] = []  # (kind, start, end): blocked time on this rank
        self._open_step: int | None = None  # events index of the decode step whose token pick is still to come

    def begin_request(self) -> None:
        self.stopped, self._open_step = False, None
        self.events.clear()

    def _flag(self, device) -> Tensor:
        return torch.tensor([float(self.signal()) if self.rank == 0 else 0.0], device=device)

    def _heard(self, flags: Tensor) -> None:
        said = int(round(float(flags.sum().item())))
        self.gathers += 1
        self.news += said

    def exchange_news(self) -> None:
        """A step boundary after a step without a gather (prompt chunks only): rank 0's word, all-reduced."""
        flag = self._flag(self.device)
        dist.all_reduce(flag)
        self._heard(flag)

    # -- the delayed reduce (issue and wait points) --
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

    def note_step(self, start: float, end: float) -> None:
        if self.record:
            self.events.append(("step", start, end))
            self._open_step = len(self.events) - 1

    def _note_pick(self, start: float) -> None:
        """The per-step gather blocks, and it is part of the decode step whose token it picks: the
        step's span is stretched to its end (a pick after the prefill belongs to no step)."""
        end = time.perf_counter()
        self.events.append(("blocking", start, end))
        if self._open_step is not None:
            kind, s, _ = self.events[self._open_step]
            self.events[self._open_step], self._open_step = (kind, s, end), None

    # -- from the head's output to tokens (docs/laneformer.md §9.4) --
    @property
    def full_logits(self) -> bool:  # the lane head all-reduces whole-vocabulary logits
        return self.cfg.lm_head_type == "lane"

    def gather_logits(self, local: Tensor, tail: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """All ranks' vocab shards [..., V_r] -> full logits [..., V] (shards are contiguous, in rank
        order, padded to one size). `tail`: a few floats per rank that ride along, returned [world, t]."""
        if self.full_logits and tail is None:
            return local, None
        tail = local.new_zeros(0) if tail is None else tail
        if self.full_logits:  # already whole on every rank: only the tail needs exchanging
            parts = [torch.empty_like(tail) for _ in range(self.world)]
            dist.all_gather(parts, tail)
            return local, torch.stack(parts)
        V = self.cfg.vocab_size
        per = math.ceil(V / self.world)
        padded = torch.nn.functional.pad(local, (0, per - local.shape[-1]), value=float("-inf"))
        payload = torch.cat([padded.flatten(), tail])
        parts = [torch.empty_like(payload) for _ in range(self.world)]
        dist.all_gather(parts, payload)
        table = torch.stack(parts)  # [world, numel + t]
        shards = table[:, :padded.numel()].view(self.world, *padded.shape)
        full = shards.movedim(0, -2).reshape(*padded.shape[:-1], self.world * per)[..., :V]
        return full, table[:, padded.numel():]

    def verify_logits(self, local: Tensor) -> Tensor:
        """A speculative verify's gather: every rank gets the whole logits [B, S, V] (so every rank keeps
        the same drafts and rolls back the same positions); rank 0's word rides along, as in `pick`."""
        t0 = time.perf_counter()
        logits, flags = self.gather_logits(local, self._flag(local.device))
        self._heard(flags)
        if self.record:
            self._note_pick(t0)
        return logits

    def agree_stop(self, should_stop) -> bool:
        """Between prefill chunks: rank 0 says whether `should_stop()`; every rank hears the same."""
        wanted = self.rank == 0 and should_stop is not None and bool(should_stop())
        flag = torch.tensor([1.0 if wanted else 0.0], device=self.device)
        dist.all_reduce(flag)
        self.stopped = self.stopped or bool(flag.item() > 0)
        return self.stopped

    def pick(self, local: Tensor, sampler: RowSampler) -> Tensor:
        """The per-step gather: per-shard top-1 when every row is greedy on the raw logits (no bias, no
        penalty, no logprobs), otherwise whole logits and the request's sampler (which handles rows with
        different settings). Every rank samples the same token with the same seeded generators and the
        same token history. Rank 0's word (`signal`) rides along."""
        params = sampler.params
        t0 = time.perf_counter()
        flag = self._flag(local.device)
        n = local.shape[0]
        if params.greedy and not self.full_logits and not sampler.needs_logits:
            best, idx = local.max(-1)
            payload = torch.cat([best, (idx + self.rows.start).float(), flag])
            parts = [torch.empty_like(payload) for _ in range(self.world)]
            dist.all_gather(parts, payload)
            table = torch.stack(parts)  # [world, 2n + 1]
            winner = table[:, :n].argmax(0)  # first maximum: the lowest rank, i.e. the lowest vocab id
            tokens = table[:, n:2 * n].gather(0, winner[None])[0].long()
            flags = table[:, -1]
        else:
            logits, flags = self.gather_logits(local, flag)
            tokens = sampler(logits)
        self._heard(flags)
        if self.record:
            self._note_pick(t0)
        return tokens


# ---- one rank -----------------------------------------------------------------------------------

class _RankEngine:
    """What `engine.batch.Sequence` reads of an engine, on a rank (no tokenizer: the front has the text side)."""

    def __init__(self, runner: LocalRunner, eos_ids: set[int]):
        self.runner, self.eos_ids, self.tokenizer = runner, eos_ids, None
        self.cfg, self.device, self.world_size = runner.cfg, runner.device, runner.world_size
        self.dtype, self.runtime = runner.runtime.torch_dtype, runner.runtime


class Rank:
    """What runs inside rank r: a LocalRunner over the plain LaneModel on this rank's lanes."""

    def __init__(self, path, runtime: Runtime, rank: int, wait_now: bool, record: bool, conn):
        cfg, src = open_checkpoint(path)
        cfg = lanes_config(cfg, runtime.world_size)
        world = runtime.world_size
        self.rank, self.conn = rank, conn
        lanes, rows = rank_lanes(cfg, rank, world), vocab_rows(cfg, rank, world)
        try:
            weights = load_weights(cfg, src, lanes, dtype=runtime.torch_dtype, device=runtime.torch_device,
                                   head_rows=rows if cfg.lm_head_type == "replicate" else None)
        finally:
            src.close()
        if runtime.weight_format:  # each rank packs its own slices
            from laneplay.kernels.lowbit import pack_weights

            weights = pack_weights(weights, runtime.weight_format)
        self.pending: deque = deque()  # the front's messages taken and not yet acted on (in batches)
        self.comm = DistLanes(cfg, rank, world, rows, wait_now=wait_now, record=record,
                              signal=self._take_messages if rank == 0 else (lambda: 0))
        self.comm.device = runtime.torch_device
        self.runner = LocalRunner(LaneModel(cfg, weights, lanes, self.comm), runtime)
        self.layer_bytes = sum(t.nbytes for k, t in weights.items() if k.startswith("layers."))
        self.head_bytes = weights["head"].nbytes
        self.lanes, self.rows = lanes, rows

    def info(self) -> dict:
        return {"lanes": [self.lanes.start, self.lanes.stop], "layer_bytes": self.layer_bytes,
                "head_bytes": self.head_bytes, "vocab_rows": [self.rows.start, self.rows.stop], "pid": os.getpid()}

    def _take_messages(self) -> int:
        """Rank 0: take what the front sent since the last look; how many (`serve`)."""
        k = 0
        while self.conn.poll():
            self.pending.append(self.conn.recv())
            k += 1
        return k

    def logits(self, ids) -> Tensor:
        return self.runner.logits(torch.tensor(ids, dtype=torch.long)).cpu()

    def serve(self, first) -> list:
        """Requests as rows of one batch (`engine.batch`, as the single-process scheduler runs them) until
        none is left; returns the messages taken meanwhile that are not about requests, in order.

        Every rank must apply the front's messages at the same step boundary, in the same order. The
        front sends each message to every rank; rank 0 takes what has arrived during a step (its count
        rides on the step's gathers, `DistLanes.signal`), and at the boundary every other rank takes as
        many from its own pipe, which holds the same messages in the same order. A request joins at the
        boundary after its "join" (prompt chunks first, then decode steps shared with the others); a
        "cancel" ends it there. Every rank runs the same steps, samples the same tokens with the same
        seeded generators and speculates alike, so rows finish at the same step everywhere; rank 0
        streams each request's tokens and its "done" to the front."""
        self.pending.append(first)
        seqs: dict[int, tuple] = {}  # rid -> (Sequence, whether it asked for speculation)
        held: list = []
        try:
            while True:
                self._apply(seqs, held)
                if not seqs or any(m[0] == "close" for m in held):
                    for rid, (seq, _) in list(seqs.items()):
                        seq.cancel()
                        self._done(rid)
                    return held + list(self.pending)
                gathers = self.comm.gathers
                self._iterate(seqs)
                if self.comm.gathers == gathers:
                    self.comm.exchange_news()
                if self.rank != 0:
                    for _ in range(self.comm.news):
                        self.pending.append(self.conn.recv())
                self.comm.news = 0
        finally:
            self.pending.clear()

    def _apply(self, seqs: dict, held: list) -> None:
        """The messages taken so far, at a step boundary: cancels end their requests, joins start theirs;
        anything else waits until the batch is empty (the front sends nothing else while requests run)."""
        while self.pending:
            msg = self.pending.popleft()
            if msg[0] == "cancel":
                if msg[1] in seqs:
                    seqs.pop(msg[1])[0].cancel()
                    self._done(msg[1])
            elif msg[0] == "join" and not held:
                _, rid, ids, params, seeds, eos_ids, speculative = msg
                if not seqs:
                    self.comm.begin_request()
                params = SamplingParams(**params)
                engine = _RankEngine(self.runner, set(eos_ids))
                seqs[rid] = (Sequence(engine, ids, params, time.perf_counter(), None, speculative, seeds, text=False),
                             speculative != "off")
            else:
                held.append(msg)

    def _iterate(self, seqs: dict) -> None:
        """One step: prompts a chunk at a time (at most one chunk's tokens in all), then one decode step
        for every request past its prompt."""
        chunk = self.runner.runtime.prefill_chunk
        for rid, seq in prompt_turns([(rid, seq) for rid, (seq, _) in seqs.items()], chunk, chunk):
            self._send_steps(rid, seq, seqs[rid][1], seq.prefill_chunk(), seqs)
        decoding = [(rid, seq, asked) for rid, (seq, asked) in seqs.items() if not seq.prefilling]
        if decoding:
            t0 = time.perf_counter()
            events = decode_step(self.runner, [s for _, s, _ in decoding])
            if self.rank == 0:  # the step's rows and time, before its tokens (the front's meters and metrics)
                self.conn.send(("step", sum(s.n for _, s, _ in decoding), time.perf_counter() - t0,
                                [rid for rid, _, _ in decoding]))
            for (rid, seq, asked), steps in zip(decoding, events):
                self._send_steps(rid, seq, asked, steps, seqs)

    def _send_steps(self, rid: int, seq, asked: bool, steps: list, seqs: dict) -> None:
        if self.rank == 0:
            counts = seq.spec.counts() if asked else None
            for host, t, logprobs in steps:
                self.conn.send(("tokens", rid, host, t, logprobs, counts))
        if seq.finished:
            seqs.pop(rid)
            self._done(rid)

    def _done(self, rid: int) -> None:
        """A request of the batch ended (on every rank at the same step): its timeline, then its "done"."""
        timelines = None
        if self.comm.record:
            timelines = [None] * self.comm.world if self.rank == 0 else None
            dist.gather_object(self.timeline_summary(), timelines, dst=0)
        if self.rank == 0:
            self.conn.send(("done", rid, timelines))

    def timeline_summary(self) -> dict:
        """This rank's decode steps of the request, aggregated (see `summarize_timeline`)."""
        return summarize_timeline(self.comm.events, self.rank)


# ---- timelines ----------------------------------------------------------------------------------

STEPS_KEPT = 64  # per rank, the last this many decode steps go to the front step by step
TIMELINE_KINDS = ("step", "issue", "wait", "exposed", "blocking")
STEP_COLUMNS = ("ms", "compute_ms", "issued", "issue_ms", "waits", "waited_ms", "exposed", "exposed_ms",
                "blocking", "blocking_ms")


def summarize_timeline(events, rank: int, keep: int = STEPS_KEPT) -> dict:
    """Where one rank's decode steps went, from its (kind, start, end) spans.

    A decode step ("step") runs from the start of the model's forward to the end of the gather that
    picks its token. Inside it: collectives issued ("issue": delayed all-reduces started), waits on
    delayed all-reduces issued `broadcast_delay` layers earlier ("wait"), immediate waits of the
    "wait now" mode ("exposed"), and blocking collectives (early layers, final aggregation, the
    token gather: "blocking"); compute is the step less the time blocked in waits, exposed waits and
    blocking collectives. Totals cover every decode step; `steps` holds the last `keep` of them, one
    list per column; spans outside any decode step (prefill, the first token's gather) are `prefill`.
    All times in ms.
    """
    spans = sorted((s, e) for k, s, e in events if k == "step")
    starts = [s for s, _ in spans]
    per = [{kind: [0, 0.0] for kind in TIMELINE_KINDS[1:]} for _ in spans]  # kind -> [count, ms]
    prefill = {kind: [0, 0.0] for kind in TIMELINE_KINDS[1:]}
    for kind, s, e in events:
        if kind == "step":
            continue
        i = bisect.bisect_right(starts, s) - 1
        slot = per[i][kind] if i >= 0 and s < spans[i][1] else prefill[kind]
        slot[0] += 1
        slot[1] += 1000 * (e - s)
    r = lambda x: round(x, 4)  # noqa: E731 - 0.1 us
    rows = []
    for (s, e), row in zip(spans, per):
        ms = 1000 * (e - s)
        blocked = row["wait"][1] + row["exposed"][1] + row["blocking"][1]
        rows.append((ms, ms - blocked, row["issue"][0], row["issue"][1], row["wait"][0], row["wait"][1],
                     row["exposed"][0], row["exposed"][1], row["blocking"][0], row["blocking"][1]))
    kept = rows[-keep:] if keep else []
    out = {"rank": rank, "decode_steps": len(rows), "first_step": len(rows) - len(kept),
           "step": {"count": len(rows), "ms": r(sum(x[0] for x in rows))}}
    for kind, (ci, mi) in (("issue", (2, 3)), ("wait", (4, 5)), ("exposed", (6, 7)), ("blocking", (8, 9))):
        out[kind] = {"count": sum(x[ci] for x in rows), "ms": r(sum(x[mi] for x in rows))}
    out["compute_ms"] = r(sum(x[1] for x in rows)) if rows else None
    out["prefill"] = {kind: {"count": c, "ms": r(ms)} for kind, (c, ms) in prefill.items()}
    out["steps"] = {col: [r(x[j]) if isinstance(x[j], float) else x[j] for x in kept]
                    for j, col in enumerate(STEP_COLUMNS)}
    return out


def rank_main(rank: int, address: str, port: int, timeout_s: float, runtime: Runtime, key: bytes) -> None:
    """A rank process: join the process group, then serve the front's messages until "close"."""
    die_with_parent(signal.SIGKILL)  # no orphaned ranks if their parent (the rank server) dies
    runtime = runtime.for_rank(rank)
    torch.set_num_threads(runtime.threads)
    conn = Client(address, family="AF_UNIX", authkey=key)
    conn.send(("hello", rank))
    if runtime.torch_device.type == "cuda":
        torch.cuda.set_device(runtime.torch_device)
    here = None
    try:
        dist.init_process_group(runtime.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=runtime.world_size, timeout=timedelta(seconds=timeout_s))
        backlog: deque = deque()  # messages a batch took that were not about its requests
        while True:
            msg = backlog.popleft() if backlog else conn.recv()
            kind = msg[0]
            if kind == "close":
                break
            if kind == "load":  # (path, wait_now, record)
                here = None
                here = Rank(msg[1], runtime, rank, msg[2], msg[3], conn)
                conn.send(("ready", rank, here.info()))
            elif kind == "configure":
                here.comm.wait_now, here.comm.record = msg[1], msg[2]
                conn.send(("configured", rank))
            elif kind == "logits":
                out = here.logits(msg[1])
                if rank == 0:  # numpy pickles by value (torch tensors would go through fd sharing)
                    conn.send(("logits", out.numpy()))
            elif kind == "join":  # a request: it runs as rows of the rank's batch (`Rank.serve`)
                backlog.extend(here.serve(msg))
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

def _rank(rank: int, address: str, port: int, timeout_s: float, runtime: dict, key: bytes) -> None:
    rank_main(rank, address, port, timeout_s, Runtime(**runtime), key)


def _rank_server():
    """Where rank processes come from: multiprocessing's fork server for this process, which imports
    torch and the engine once (about 2.5 s of CPU) and forks every rank from there, so a rank starts in
    milliseconds. It starts with the first DTP engine, keeps this process's environment as it was then,
    and ends with this process (its ranks with it: `die_with_parent`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class RankProcess:
    """A rank forked by the rank server, seen through subprocess.Popen's interface."""

    def __init__(self, process):
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N: killed by signal N, as Popen reports it

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"DTP rank (pid {self.pid})", timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


class DTPRunner:
    """The runner the engine's front end drives when the lanes live on `world_size` rank processes.

    Rank 0 streams each step's tokens back; the ranks run the decode loop on their own (no per-token
    round trip through this process), so this runner's `token_steps` relays rank 0's stream and sends
    a cancel when the consumer stops early. Requests at once (each `token_steps` in a thread of its
    own) become rows of the ranks' shared steps (`batches_itself`, `Rank.serve`); whichever waiting
    thread holds the pipe files rank 0's messages under their requests. The ranks also run a request's
    prompt-lookup speculation (`speculates`): drafts and verifies happen on every rank alike.
    """

    speculates = True

    def __init__(self, path, runtime: Runtime, wait_now: bool = False, timeline: bool = False,
                 timeout_s: float = 60.0):
        self.runtime, self.world_size, self.timeout_s = runtime, runtime.world_size, timeout_s
        # Requests at once: the ranks run them as rows of one batch (`Rank.serve`), each streamed by its
        # own `token_steps` (in its own thread)
        self.batches_itself = True
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self._boxes: dict[int, deque] = {}  # rank 0's messages for each running request, not yet read
        self.on_step = None  # (rows, seconds) of each of the ranks' shared decode steps (the server's metrics)
        self._steps: dict[int, tuple[int, int, int]] = {}  # request -> (rows, other requests, step) of its last shared step
        self._step_count = 0
        self._here = threading.local()  # the request that this thread streams
        self.device = runtime.torch_device
        self.wait_now, self.record_timeline = bool(wait_now), bool(timeline)
        self.last_timeline: dict | None = None
        self.rank_info: list[dict] = []
        self._ids = itertools.count()
        self._failure: str | None = None
        self.conns, self.procs = [], []
        key = secrets.token_bytes(32)
        self._sockdir = tempfile.mkdtemp(prefix="laneplay-dtp-")
        address = os.path.join(self._sockdir, "front.sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            port, ctx = free_port(), _rank_server()
            for rank in range(self.world_size):  # daemons: ended (SIGTERM) if this process exits first
                proc = ctx.Process(target=_rank, args=(rank, address, port, timeout_s, runtime.to_dict(), key),
                                   name=f"laneplay-dtp-rank-{rank}", daemon=True)
                proc.start()
                self.procs.append(RankProcess(proc))
            self.conns = self._accept(listener, deadline=time.monotonic() + max(120.0, timeout_s))
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        try:
            self.load(path)
        except BaseException:
            self.close()
            raise

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

    def _send(self, msg) -> None:
        """`msg` to every rank."""
        self._check_usable()
        with self._send_lock:  # requests in several threads: each message whole, in one order on every pipe
            for rank in range(self.world_size):
                try:
                    self.conns[rank].send(msg)
                except (BrokenPipeError, OSError):
                    self._fail(f"rank {rank} is gone (exit code {self.procs[rank].poll()})")

    def _recv(self, any_rank: bool = False, timeout: float | None = None, while_waiting=None):
        """The next message from rank 0 (or any rank); a dead or failing rank raises DTPError.
        `while_waiting()` is called every 20 ms while nothing arrives (e.g. to pass on a cancel)."""
        timeout = timeout if timeout is not None else self.timeout_s + 30
        deadline = time.monotonic() + timeout
        rank_of = {c: r for r, c in enumerate(self.conns)}
        tick = 0.02 if while_waiting is not None else 1.0
        while True:
            ready = wait_for(list(rank_of), timeout=min(tick, max(0.0, deadline - time.monotonic())))
            if not ready and while_waiting is not None:
                while_waiting()
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
    def _between_requests(self, what: str) -> None:
        """load, configure and logits talk to the ranks outside any request: none may be streaming."""
        if self._boxes:
            raise DTPError(f"{what} runs between requests on a DTP engine; {len(self._boxes)} are running")

    def load(self, path) -> None:
        """(Re)load a checkpoint into the running ranks; each reads only its own lanes' slices."""
        self._between_requests("load")
        self._send(("load", str(path), self.wait_now, self.record_timeline))
        self.rank_info = self._gather_replies("ready", timeout=max(300.0, self.timeout_s))

    def configure(self, wait_now: bool | None = None, timeline: bool | None = None) -> None:
        """Switch between delayed and "wait now" collectives, and the per-rank timeline, between requests."""
        self.wait_now = self.wait_now if wait_now is None else bool(wait_now)
        self.record_timeline = self.record_timeline if timeline is None else bool(timeline)
        self._between_requests("configure")
        self._send(("configure", self.wait_now, self.record_timeline))
        self._gather_replies("configured", timeout=self.timeout_s)

    @property
    def collectives(self) -> str:
        return "wait_now" if self.wait_now else "delayed"

    @contextmanager
    def request_settings(self, wait_now: bool | None = None, timeline: bool = False):
        """One request's collectives (None: the engine's own) and timeline recording, set before it and
        put back after; each change is one round trip to the ranks, so only changes are sent. Yields
        the collectives the request runs with; `last_timeline` is cleared first, so afterwards it is
        this request's (None when nothing was recorded)."""
        before = (self.wait_now, self.record_timeline)
        want = (before[0] if wait_now is None else bool(wait_now), before[1] or bool(timeline))
        self.last_timeline = None
        if want != before:
            self.configure(*want)
        try:
            yield self.collectives
        finally:
            if want != before and not self._failure:
                self.configure(*before)

    def _timeline(self, ranks: list[dict] | None) -> dict | None:
        """The request's timeline: every rank's summary under "ranks"; the top-level totals are rank 0's."""
        if not ranks:
            return None
        top = {k: ranks[0][k] for k in ("step", "issue", "wait", "exposed", "blocking", "compute_ms")}
        return {"collectives": self.collectives, "world_size": self.world_size, "steps_kept": STEPS_KEPT,
                **top, "ranks": ranks}

    # -- the runner surface the front end uses --
    def logits(self, ids: Tensor) -> Tensor:
        self._between_requests("logits")
        self._send(("logits", ids.tolist()))
        return torch.from_numpy(self._recv()[1])

    def token_steps(self, ids, params, seeds, eos_ids, should_stop=None, spec=None):
        """Rank 0's (tokens, time, logprobs) stream for one request; stopping early cancels it on all ranks.
        spec: the request's `engine.speculative.Speculation`; the ranks run their own and rank 0's counts
        are copied into it as the tokens come."""
        rid = next(self._ids)
        self._boxes[rid] = deque()
        self._here.rid = rid
        # params: asdict(SamplingParams) (per-sample dicts are rebuilt by it); a cancel goes to every rank,
        # and each applies it at the same step boundary
        self._send(("join", rid, ids, asdict(params), seeds, sorted(eos_ids), spec.mode if spec else "off"))
        cancel_sent = finished = False

        def check_stop():  # also while the ranks are busy in a long prefill and nothing arrives
            nonlocal cancel_sent
            if should_stop is not None and not cancel_sent and should_stop():
                self._send(("cancel", rid))
                cancel_sent = True

        try:
            while True:
                check_stop()
                msg = self._next(rid, check_stop)
                if msg[0] == "done" and msg[1] == rid:
                    self.last_timeline, finished = self._timeline(msg[2]), True
                    return
                if msg[0] == "tokens" and msg[1] == rid:
                    if spec is not None:
                        spec.take_counts(msg[5])
                    yield msg[2], msg[3], msg[4]
        finally:
            if not finished and not self._failure:  # the consumer stopped early: stop the ranks too
                if not cancel_sent:
                    self._send(("cancel", rid))
                while (msg := self._next(rid))[:2] != ("done", rid):
                    pass
                self.last_timeline = self._timeline(msg[2])
            self._boxes.pop(rid, None)
            self._steps.pop(rid, None)

    def last_step(self) -> tuple[int, int, int] | None:
        """(rows, other requests, step number) of the last shared decode step of the request this thread streams."""
        return self._steps.get(getattr(self._here, "rid", None))

    def _next(self, rid: int, while_waiting=None):
        """Rank 0's next message for request rid. Whichever waiting request holds the receiving lock reads
        the pipe and files each message under its request; the others look at their box every 20 ms."""
        box = self._boxes[rid]
        while True:
            if box:
                return box.popleft()
            self._check_usable()
            if not self._recv_lock.acquire(timeout=0.02):
                if while_waiting is not None:
                    while_waiting()
                continue
            try:
                if box:
                    continue
                msg = self._recv(while_waiting=while_waiting)
                if msg[0] == "step":  # ("step", rows, seconds, requests)
                    self._step_count += 1
                    for r in msg[3]:
                        self._steps[r] = (msg[1], len(msg[3]) - 1, self._step_count)
                    if self.on_step is not None:
                        self.on_step(msg[1], msg[2])
                    continue
                if msg[0] in ("tokens", "done") and msg[1] != rid:
                    if msg[1] in self._boxes:
                        self._boxes[msg[1]].append(msg)
                    continue
                return msg
            finally:
                self._recv_lock.release()

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
