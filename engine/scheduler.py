"""The request scheduler: iteration-level batching, latency first.

One worker thread runs the engine. Where the engine's runner can put separate requests in one step
(one process: `LocalRunner.batchable`; with the CUDA static step, their rows share its cache and a
graph per bucket of rows), the worker runs iterations: at each step
boundary finished or cancelled requests leave and waiting ones join; a joining prompt is prefilled a
chunk at a time (at most `prefill_budget` prompt tokens per iteration), and then every decoding request
gets one token in one shared forward (`engine.batch`). A request's tokens do not depend on who else is
in the batch. DTP ranks batch requests themselves (`DTPRunner.batches_itself`: the same steps, run on
every rank): there each running request streams through a thread of its own. A runner that can do
neither runs requests one at a time, in order.

Admission, stated as policy:
- interactive requests (the default) join before batch ones (`priority="batch"`: pass@N jobs, evals),
  each class in arrival order; a request that does not fit waits with its place in line;
- at most `max_rows` rows decode per step (a request of n samples is n rows): on the CPU's low-bit
  path 16, the most rows whose products keep the one-row arithmetic (bench/results/batching.json has
  what a row costs);
- batch requests leave `interactive_reserve` rows free, so an interactive request always joins at the
  next step boundary;
- while interactive requests decode, a step takes batch requests beside them only up to `shared_rows`
  rows in all (4 by default: what a step of 4 rows costs over one is what an interactive request pays,
  bench/results/batching.json); the batch requests that do not fit wait that step out with their
  caches kept (they resume exactly where they were), so a pass@N run slows, not the Playground;
- the rows' KV caches together stay within the engine's KV budget;
- while interactive requests decode, prompt chunks take at most `prefill_share` of the engine's time
  (3/4 by default): after a chunk of d seconds the decoding rows step for d (1 - share) / share seconds
  before the next chunk runs, so a long prompt joining slows their streams instead of stopping them
  (a 128-token chunk of the default model takes 400-600 ms on two cores, a step ~10 ms: one token per
  chunk would be ~2 tokens/s). With no interactive request decoding, chunks run back to back: a
  request alone prefills as fast as ever.

Generation is synchronous torch code, so it runs in this thread, never on the event loop; each event
crosses over to the request's asyncio.Queue through its loop's mailbox (one `call_soon_threadsafe` for all
the events that arrive before the loop runs). A request whose client
went away is dropped if it is still waiting, or stopped at the next step boundary if it runs; one
running past the time limit is stopped the same way (the server reports it as finished by "length").
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from laneplay.engine.batch import PrefixCache, Sequence, decode_step, kv_need, prompt_turns
from laneplay.engine.metrics import GenerationMetrics
from laneplay.engine.runtime import PREFILL_CHUNK
from laneplay.engine.sampling import SamplingParams
from laneplay.engine.speculative import check_mode as check_speculative

log = logging.getLogger("laneplay.engine")

_DONE = object()  # end of a job's event stream
PRIORITIES = ("interactive", "batch")
MAX_ROWS = 16  # rows per decode step (see the module's policy)
INTERACTIVE_RESERVE = 4  # rows batch requests leave free
SHARED_ROWS = 4  # rows in a step where interactive requests decode beside batch ones
# A batch request's prompt runs on the fused step in pieces of at most this many positions, a step each: an
# interactive request arriving meanwhile waits for one piece (~20 ms on 2 cores), not a whole chunk (~70 ms).
BATCH_PIECE = 32
PREFILL_SHARE = 0.75  # the most of the engine's time prompt chunks take while interactive requests decode


class QueueFull(Exception):
    pass


class _Mailbox:
    """Events from the worker thread to one event loop, in order, with one wake-up of the loop for all that
    arrive before it runs: a step's events for every request on that loop cost one wake-up, not one each
    (each wake-up is a write to the loop's self-pipe, and the loop's thread then takes a core from the step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.waking = loop, [], threading.Lock(), False

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.waking:
                return
            self.waking = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self.lock:
                self.items.clear()
                self.waking = False
            raise

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.waking = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = _Mailbox(loop)
        return box


STARTED = object()  # pushed into a job's stream when the worker starts it (it was queued until then)


@dataclass(frozen=True)
class Queued:
    """Pushed into a waiting job's stream when its place in line changes (1: it starts next)."""
    position: int


@dataclass(eq=False)
class Job:
    """One admitted request: its prompt ids and params, its event queue, and what happened to it."""
    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    seq: int  # arrival order (1, 2, ...)
    priority: str = "interactive"
    t_arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    start_seq: int | None = None  # order in which the worker started jobs
    t_start: float | None = None
    cancelled: bool = False  # the client went away; plain bool: read once per step, set from the loop
    timed_out: bool = False
    outcome: str | None = None  # completed | cancelled | timeout | dropped | error
    finals: dict[int, GenerationMetrics] = field(default_factory=dict)  # sample index -> final metrics
    dtp: dict | None = None  # this request's DTP settings: {"collectives": str | None, "timeline": bool}
    collectives: str | None = None  # what it ran with ("delayed" | "wait_now"), when it asked
    timeline: dict | None = None  # its per-rank timeline, when it asked for one
    # Sharing: decode steps this job took part in, the rows in them, and the other requests in the last one.
    steps: int = 0
    step_rows: int = 0
    sharing: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    position: int | None = None  # its place in line, as last told to it
    speculative: str = "auto"  # prompt-lookup speculation asked for: "auto" | "lookup" | "off"

    @property
    def queue_ms(self) -> float | None:
        return None if self.t_start is None else (self.t_start - self.t_arrival) * 1000

    @property
    def rows_per_step(self) -> float | None:
        return self.step_rows / self.steps if self.steps else None

    def push(self, item) -> None:
        """Called from the worker thread: hand one event (or the end, or an error) to the event loop."""
        try:
            _mailbox(self.loop).post(self.events, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    async def stream(self) -> AsyncIterator:
        """The job's GenerationEvents, as the worker produces them (Queued when its place in line moves,
        STARTED when the engine takes the job); re-raises an engine error."""
        while (item := await self.events.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    def __init__(self, engine, max_queue: int = 32, request_timeout_s: float = 600.0,
                 on_finish: Callable[[Job], None] | None = None, max_rows: int = MAX_ROWS,
                 interactive_reserve: int = INTERACTIVE_RESERVE, prefill_budget: int | None = None,
                 prefix_cache: bool = True, shared_rows: int = SHARED_ROWS, prefill_share: float = PREFILL_SHARE):
        self.engine = engine
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.on_finish = on_finish  # metrics hook; called once per job, whatever its outcome
        runner = getattr(engine, "runner", None)
        self.batched = bool(getattr(runner, "batchable", False))
        self.concurrent = not self.batched and bool(getattr(runner, "batches_itself", False))
        self.max_rows = max_rows if self.batched or self.concurrent else 1
        if self.concurrent:  # the ranks' steps, as the front hears of them
            runner.on_step = lambda rows, seconds: self.on_step and self.on_step(rows, seconds)
        self.interactive_reserve = min(interactive_reserve, max_rows - 1)
        self.shared_rows = shared_rows
        runtime = getattr(engine, "runtime", None)
        self.prefill_budget = prefill_budget or getattr(runtime, "prefill_chunk", PREFILL_CHUNK)
        if not 0 < prefill_share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {prefill_share}")
        self.prefill_share = prefill_share
        self._decode_owed = 0.0  # seconds of decode steps due before the next prompt chunk (prefill_share)
        self.kv_budget = getattr(runtime, "kv_budget_bytes", 0) or 0
        self.on_step: Callable[[int, float], None] | None = None  # (rows, seconds) of each decode step
        self.prefixes = None  # recently prefilled prompts' KV (batched engines): up to a quarter of the budget
        if self.batched and prefix_cache:
            self.prefixes = PrefixCache(runtime.prefill_chunk, (self.kv_budget or 2**31) // 4)
        self.running: list[Job] = []
        self.mean_job_s = 1.0  # moving average of job duration, for Retry-After
        self._waiting: list[Job] = []  # in admission order: interactive first, each class by arrival
        self._cond = threading.Condition()
        self._arrivals = itertools.count(1)
        self._starts = itertools.count(1)
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def start(self) -> None:
        target = self._work_batched if self.batched else self._work
        self._thread = threading.Thread(target=target, name="laneplay-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        """Drop waiting jobs, stop the running ones at their next step, and wait for the worker
        (timeout 0: don't wait). Safe to call more than once."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), []
            for job in self.running:
                job.cancelled = True
            self._cond.notify_all()
        for job in waiting:
            self._drop(job)
        if self._thread is not None and timeout != 0:
            self._thread.join(timeout)

    def submit(self, ids: list[int], params: SamplingParams, dtp: dict | None = None,
               priority: str = "interactive", speculative: str = "auto") -> Job:
        """Queue a validated request (call from the event loop); raises QueueFull when the queue is full.
        `dtp`: the request's own DTP settings (`Engine.request_settings`), applied while it runs;
        `priority`: "interactive" or "batch" (joins only where interactive requests leave room);
        `speculative`: "auto", "lookup" or "off" (engine/speculative.py; a speculating request runs its
        verify steps as forwards of its own beside the shared step)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        check_speculative(speculative)
        with self._cond:
            if self._closed or len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the engine queue is full ({self.max_queue} requests waiting); retry later")
            job = Job(ids, params, asyncio.get_running_loop(), seq=next(self._arrivals), dtp=dtp, priority=priority,
                      speculative=speculative)
            if priority == "interactive":  # ahead of every waiting batch job, behind interactive ones
                at = next((i for i, j in enumerate(self._waiting) if j.priority == "batch"), len(self._waiting))
                self._waiting.insert(at, job)
            else:
                self._waiting.append(job)
            job.position = self._waiting.index(job) + 1
            self._tell_positions()
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone (or the response ended): drop the job if waiting, stop it if running."""
        with self._cond:
            if job.outcome is not None:
                return
            job.cancelled = True
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running: the worker sees the flag at the next step boundary
            self._tell_positions()
        self._drop(job)

    def position(self, job: Job) -> int | None:
        """1 for the next job to start, 2 after it, ...; None when the job is not waiting."""
        with self._cond:
            try:
                return self._waiting.index(job) + 1
            except ValueError:
                return None

    def _drop(self, job: Job) -> None:
        job.outcome = "dropped"
        job.push(_DONE)
        self._finished(job)

    def _finished(self, job: Job) -> None:
        if self.on_finish:
            try:
                self.on_finish(job)
            except Exception:  # metrics must never take the worker down
                log.exception("on_finish failed")

    def _begin(self, job: Job) -> None:
        job.t_start, job.start_seq = time.perf_counter(), next(self._starts)
        job.push(STARTED)

    def _end(self, job: Job, outcome: str, locked: bool = False) -> None:
        job.outcome = outcome
        with nullcontext() if locked else self._cond:
            self.running.remove(job)
            self._cond.notify_all()  # room for a waiting job (the worker of requests at once waits for it)
        self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - job.t_start) / max(1, len(self.running) + 1)
        job.push(_DONE)
        self._finished(job)

    # ---- requests not batched here: each in a thread of its own while the runner batches them itself
    # (DTP ranks: `DTPRunner.batches_itself`), or one at a time ----
    def _work(self) -> None:
        """One at a time: each job runs here, to its end. Batched by the runner: each admitted job streams
        through `_run` in a thread of its own while the ranks put the running requests' rows in one step;
        admission is `_admit`'s policy (rows, KV budget, interactive first, the reserve). A request with
        its own DTP settings (collectives, timeline: the DTP view's A/B runs) changes them on every rank
        for as long as it runs, so it runs alone: it waits for the running ones to finish, and nothing
        joins it."""
        while True:
            with self._cond:
                while not self._closed and not self._startable():
                    self._cond.wait()
                if self._closed:
                    return
                job = self._waiting.pop(0)
                self.running.append(job)
                self._tell_positions()
            if self.concurrent:
                threading.Thread(target=self._run, args=(job,), name=f"laneplay-request-{job.seq}", daemon=True).start()
            else:
                self._run(job)

    def _startable(self) -> bool:
        """Whether the head of the line may start now (called under the lock)."""
        if not self._waiting:
            return False
        if not self.running:
            return True
        job = self._waiting[0]
        if not self.concurrent or job.dtp or any(j.dtp for j in self.running):
            return False
        return self._fits(job, sum(j.params.n for j in self.running),
                          sum(kv_need(self.engine, j.ids, j.params) for j in self.running))

    def _fits(self, job: Job, rows: int, kv: int) -> bool:
        """Whether `job` may join running requests that hold `rows` rows and `kv` bytes of KV cache: within
        the rows per step (less the interactive reserve for batch work) and the KV budget."""
        cap = self.max_rows - (self.interactive_reserve if job.priority == "batch" else 0)
        return rows + job.params.n <= cap and not (
            self.kv_budget and kv + kv_need(self.engine, job.ids, job.params) > self.kv_budget)

    def _run(self, job: Job) -> None:
        self._begin(job)
        deadline = job.t_start + self.request_timeout_s

        def should_stop() -> bool:
            if time.perf_counter() > deadline:
                job.timed_out = True
            return job.cancelled or job.timed_out

        stopped = False
        wants_timeline = bool(job.dtp and job.dtp.get("timeline"))
        try:  # a request with DTP settings runs alone (`_startable`), so they hold for it alone
            with self.engine.request_settings(**job.dtp) if job.dtp else nullcontext() as job.collectives:
                last = seen = None
                for ev in self.engine.generate(job.ids, job.params, should_stop=should_stop,
                                               speculative=job.speculative):
                    step = self.concurrent and self.engine.runner.last_step()
                    if step and step != seen:  # the ranks' shared step this token came from
                        rows, job.sharing, _ = step
                        job.steps += 1
                        job.step_rows += rows
                    seen = step
                    if ev.finish_reason:
                        job.finals[ev.sample_index] = ev.metrics
                        stopped |= ev.finish_reason == "cancelled"
                        if wants_timeline and len(job.finals) == job.params.n:
                            last = ev  # the last event waits for the timeline: it comes once the ranks finish
                            continue
                    job.push(ev)
                if wants_timeline:
                    job.timeline = self.engine.last_timeline
                if last is not None:
                    job.push(last)
        except Exception as e:
            log.exception("generation failed")
            job.push(e)
            self._end(job, "error")
            return
        self._end(job, ("timeout" if job.timed_out else "cancelled") if stopped else "completed")

    # ---- iteration-level batches ----
    def _admit(self, seqs: dict) -> None:
        """Move waiting jobs that fit into the batch, in admission order (called under the lock). The
        head of the line that does not fit waits, and nothing behind it jumps ahead."""
        rows = sum(j.params.n for j in self.running)
        kv = sum(s.kv_bytes for s in seqs.values())
        while self._waiting:
            job = self._waiting[0]
            need = kv_need(self.engine, job.ids, job.params)
            if self.running and not self._fits(job, rows, kv):
                break
            if self.prefixes is not None and self.kv_budget:  # running requests first: cached prefixes make room
                self.prefixes.shrink(self.kv_budget - kv - need)
            self._waiting.pop(0)
            self.running.append(job)
            self._begin(job)
            try:
                seqs[job] = Sequence(self.engine, job.ids, job.params, job.t_start, self.prefixes, job.speculative,
                                     piece=BATCH_PIECE if job.priority == "batch" else None)
                job.cached_tokens = seqs[job].reused
            except Exception as e:
                log.exception("generation failed")
                job.push(e)
                self._end(job, "error", locked=True)
                continue
            rows += job.params.n
            kv += need
        self._tell_positions()

    def _tell_positions(self) -> None:
        """Each waiting job whose place in line moved hears its new one (called under the lock)."""
        for i, job in enumerate(self._waiting, 1):
            if job.position is not None and job.position != i:
                job.position = i
                job.push(Queued(i))
    def _work_batched(self) -> None:
        seqs: dict[Job, object] = {}  # running job -> its Sequence
        while True:
            with self._cond:
                while not self._waiting and not self.running and not self._closed:
                    self._cond.wait()
                if self._closed and not self.running:
                    return
                if not self._closed:
                    self._admit(seqs)
            try:
                self._iterate(seqs)
            except Exception as e:  # an engine failure ends the requests in the batch, never the worker
                log.exception("generation failed")
                for job in list(seqs):
                    seqs.pop(job).cancel()
                    job.push(e)
                    self._end(job, "error")

    def _iterate(self, seqs: dict) -> None:
        """One step boundary: stopped requests leave, prompts advance (unless the decoding rows are owed
        time, see `prefill_share`), every decoding row gets a token."""
        self._leave(seqs)
        streaming = any(j.priority == "interactive" and not s.prefilling and not s.finished for j, s in seqs.items())
        if not streaming:
            self._decode_owed = 0.0
        # interactive prompts first: one that arrives while a batch prompt is prefilling runs its chunk next
        turns = () if self._decode_owed > 0 else prompt_turns(
            sorted(seqs.items(), key=lambda js: js[0].priority != "interactive"), self.prefill_budget,
            self.engine.runtime.prefill_chunk)
        t_chunks = time.perf_counter()
        for job, seq in turns:
            try:
                events = seq.prefill_chunk()
            except Exception as e:  # this prompt failed (memory, say): it ends, the others go on
                log.exception("generation failed")
                seqs.pop(job).cancel()
                job.push(e)
                self._end(job, "error")
                continue
            self._emit(job, events)
            if seq.finished:
                self._complete(job, seqs)
        if streaming and self._decode_owed <= 0:
            self._decode_owed = (time.perf_counter() - t_chunks) * (1 - self.prefill_share) / self.prefill_share
        self._leave(seqs)  # a stop that came during the prompts ends before the next token, as alone
        decoding = self._step_rows([(j, s) for j, s in seqs.items() if not s.prefilling and not s.finished])
        if not decoding:
            return
        t0 = time.perf_counter()
        events = decode_step(self.engine.runner, [s for _, s in decoding])
        rows, seconds = sum(s.n for _, s in decoding), time.perf_counter() - t0
        self._decode_owed -= seconds
        if self.on_step:
            self.on_step(rows, seconds)
        for (job, seq), evs in zip(decoding, events):
            job.steps += 1
            job.step_rows += rows
            job.sharing = len(decoding) - 1
            self._emit(job, evs)
            if seq.finished:
                self._complete(job, seqs)

    def _step_rows(self, ready: list) -> list:
        """Which decoding requests this step runs: every interactive one, and batch ones beside them up to
        `shared_rows` rows in all (all of them when no interactive request decodes)."""
        if not any(j.priority == "interactive" for j, _ in ready) or all(j.priority == "interactive" for j, _ in ready):
            return ready
        rows = sum(s.n for j, s in ready if j.priority == "interactive")
        out = []
        for job, seq in ready:
            if job.priority == "batch":
                if rows + seq.n > self.shared_rows:
                    continue  # it waits this step out, its cache kept
                rows += seq.n
            out.append((job, seq))
        return out

    def _leave(self, seqs: dict) -> None:
        """Cancelled and timed-out requests leave the batch (their open samples end "cancelled")."""
        now = time.perf_counter()
        for job, seq in list(seqs.items()):
            if seq.chunks and now > job.t_start + self.request_timeout_s:  # as alone: checked once work began
                job.timed_out = True
            if job.cancelled or job.timed_out:
                self._emit(job, seqs.pop(job).cancel())
                self._end(job, "timeout" if job.timed_out else "cancelled")

    def _emit(self, job: Job, events) -> None:
        for ev in events:
            if ev.finish_reason:
                job.finals[ev.sample_index] = ev.metrics
            job.push(ev)

    def _complete(self, job: Job, seqs: dict) -> None:
        seqs.pop(job)
        self._end(job, "completed")
