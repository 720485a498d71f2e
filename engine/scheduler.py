"""The request scheduler: one worker thread runs requests one at a time, in arrival order.

Latency first: the running request has the whole engine (its n samples decode as one batch), so its
TTFT and tokens/s are what it would get alone; later requests wait in a bounded FIFO. Generation is
synchronous torch code, so it runs in this thread, never on the event loop; each event crosses over
to the request's asyncio.Queue with one `call_soon_threadsafe`.

A request whose client went away is dropped if it is still waiting, or stopped at its next token if
it runs (the engine polls `should_stop` once per decode step). A request running past the time limit
is stopped the same way; the server reports it as finished by "length".
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from laneplay.engine.metrics import GenerationMetrics
from laneplay.engine.sampling import SamplingParams

log = logging.getLogger("laneplay.engine")

_DONE = object()  # end of a job's event stream


class QueueFull(Exception):
    pass


STARTED = object()  # pushed into a job's stream when the worker starts it (it was queued until then)


@dataclass(eq=False)
class Job:
    """One admitted request: its prompt ids and params, its event queue, and what happened to it."""
    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    seq: int  # arrival order (1, 2, ...)
    t_arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    start_seq: int | None = None  # order in which the worker started jobs
    t_start: float | None = None
    cancelled: bool = False  # the client went away; plain bool: read once per token, set from the loop
    timed_out: bool = False
    outcome: str | None = None  # completed | cancelled | timeout | dropped | error
    finals: dict[int, GenerationMetrics] = field(default_factory=dict)  # sample index -> final metrics
    dtp: dict | None = None  # this request's DTP settings: {"collectives": str | None, "timeline": bool}
    collectives: str | None = None  # what it ran with ("delayed" | "wait_now"), when it asked
    timeline: dict | None = None  # its per-rank timeline, when it asked for one

    @property
    def queue_ms(self) -> float | None:
        return None if self.t_start is None else (self.t_start - self.t_arrival) * 1000

    def push(self, item) -> None:
        """Called from the worker thread: hand one event (or the end, or an error) to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    async def stream(self) -> AsyncIterator:
        """The job's GenerationEvents, as the worker produces them (and STARTED when the engine takes
        the job); re-raises an engine error."""
        while (item := await self.events.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    def __init__(self, engine, max_queue: int = 32, request_timeout_s: float = 600.0,
                 on_finish: Callable[[Job], None] | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.on_finish = on_finish  # metrics hook; called once per job, whatever its outcome
        self.running: Job | None = None
        self.mean_job_s = 1.0  # moving average of job duration, for Retry-After
        self._waiting: deque[Job] = deque()
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
        return self.running is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="laneplay-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        """Drop waiting jobs, stop the running one at its next token, and wait for the worker (timeout 0:
        don't wait). Safe to call more than once."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            if self.running is not None:
                self.running.cancelled = True
            self._cond.notify_all()
        for job in waiting:
            self._drop(job)
        if self._thread is not None and timeout != 0:
            self._thread.join(timeout)

    def submit(self, ids: list[int], params: SamplingParams, dtp: dict | None = None) -> Job:
        """Queue a validated request (call from the event loop); raises QueueFull when the queue is full.
        `dtp`: the request's own DTP settings (`Engine.request_settings`), applied while it runs."""
        with self._cond:
            if self._closed or len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the engine queue is full ({self.max_queue} requests waiting); retry later")
            job = Job(ids, params, asyncio.get_running_loop(), seq=next(self._arrivals), dtp=dtp)
            self._waiting.append(job)
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
                return  # running: the worker sees the flag at the next token
        self._drop(job)

    def _drop(self, job: Job) -> None:
        job.outcome = "dropped"
        job.push(_DONE)
        if self.on_finish:
            self.on_finish(job)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self.running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None
                self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - job.t_start)
                if self.on_finish:
                    try:
                        self.on_finish(job)
                    except Exception:  # metrics must never take the worker down
                        log.exception("on_finish failed")

    def position(self, job: Job) -> int | None:
        """1 for the next job to run, 2 after it, ...; None when the job is not waiting."""
        with self._cond:
            try:
                return self._waiting.index(job) + 1
            except ValueError:
                return None

    def _run(self, job: Job) -> None:
        job.t_start, job.start_seq = time.perf_counter(), next(self._starts)
        job.push(STARTED)
        deadline = job.t_start + self.request_timeout_s

        def should_stop() -> bool:
            if time.perf_counter() > deadline:
                job.timed_out = True
            return job.cancelled or job.timed_out

        stopped = False
        wants_timeline = bool(job.dtp and job.dtp.get("timeline"))
        try:  # requests run one at a time, so a request's DTP settings hold for it alone
            with self.engine.request_settings(**job.dtp) if job.dtp else nullcontext() as job.collectives:
                last = None
                for ev in self.engine.generate(job.ids, job.params, should_stop=should_stop):
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
            job.outcome = "error"
            job.push(e)
            return
        job.outcome = ("timeout" if job.timed_out else "cancelled") if stopped else "completed"
        job.push(_DONE)
