"""pass@N runs as server-side jobs: they outlive the page that started them.

A run is a stored comparison (`storage`) plus an asyncio task in the app's process. For each problem it
asks the engine for the greedy answer and for N samples as one batched request, checks every answer
in the sandbox (`app.checks`: at most one program per core, across all tabs and jobs), and stores each
outcome as soon as it is known, so a reload, a closed tab or a killed server loses nothing that
finished. Reopening a run reads its progress from the database.

Bounds (`app.quota`): one active run per owner, at most a quarter of the server's active slots per
client address (so made-up owners from one address cannot fill them), at most `max_running` generating at
a time (later ones wait as `queued`), at most `max_active` queued or running in all; past them, `start`
refuses with `Busy`. Every store write of a job is made as its owner.
When the run starts it measures the engine's decode step time at each batch size k <= N (a short
request per k), which is what the latency cost per k is computed from.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from laneplay.app.checks import SandboxMissing, check_code, sandbox_status
from laneplay.api_client import EngineClient, EngineError
from laneplay.app.params import InputError, sampling
from laneplay.app.stream import Generation, collect, engine_ready
from laneplay.app.quota import PASSN_ACTIVE, PASSN_ACTIVE_PER_ADDRESS, PASSN_RUNNING
from laneplay.limits import MAX_N
from laneplay.evals.passk import KS, count_statuses, mean_pass_at_ks
from laneplay.evals.engine_generate import request_body as remote_request_body
from laneplay.evals.problems import Problem
from laneplay.evals.prompting import (chat_messages, completion_prompt, extract_code,
                                      extract_completion)

log = logging.getLogger("laneplay.app.jobs")

N_CHOICES = tuple(k for k in KS if k <= MAX_N)  # 1, 2, 4, 8, 16: the k of the pass@k table
MAX_RUN_PROBLEMS = 40  # one run; HumanEval has 164 (a full sweep is `laneplay eval`'s job)
CALIBRATION_TOKENS = 16
BUSY_RETRIES = 20


class Busy(Exception):
    """The run was not started: the owner already has one going, or the server is at its bound."""


class RunInputError(ValueError):
    """A run configuration that cannot be used (the message says why); nothing is stored or sent."""


@dataclass
class RunConfig:
    n: int = 4
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int = 0
    mode: str = "instruct"  # "instruct": chat template, code from the answer; "base": completion
    timeout_s: float = 10.0

    def validate(self, info: dict | None = None) -> None:
        """The engine's bounds (`app.params`; `info`: the engine's, whose context bounds max_tokens), and
        pass@N's own: N a power of two for the pass@k table, sampled (temperature > 0: the greedy answer
        is always part of the run), a per-check timeout the sandbox allows."""
        if self.n not in N_CHOICES:
            raise RunInputError(f"N must be one of {', '.join(map(str, N_CHOICES))} (got {self.n}).")
        if self.temperature == 0:
            raise RunInputError("The sampling temperature must be greater than 0; the greedy baseline is always "
                                "part of the run.")
        try:
            sampling(self.temperature, self.top_p, 0, self.max_tokens, self.seed, None, info, n=self.n)
        except InputError as e:
            raise RunInputError(str(e)) from None
        if self.mode not in ("instruct", "base"):
            raise RunInputError(f"Mode must be instruct or base (got {self.mode}).")
        if not 0.5 <= self.timeout_s <= 60.0:
            raise RunInputError(f"The per-check timeout must be between 0.5 and 60 s (got {self.timeout_s}).")


@dataclass
class _Job:
    id: str
    owner: str
    address: str
    problems: list[Problem]
    config: RunConfig
    created: float = field(default_factory=time.monotonic)
    started: float | None = None  # when it left the queue
    phase: str = "queued"
    checked: int = 0
    task: asyncio.Task | None = None


def prompt_of(problem: Problem, mode: str) -> tuple[object, bool]:
    """(prompt or messages, chat?) exactly as `laneplay eval` builds them."""
    return (chat_messages(problem), True) if mode == "instruct" else (completion_prompt(problem), False)


def request_body(problem: Problem, config: RunConfig, n: int, temperature: float, max_tokens: int | None = None,
                 model: str | None = None) -> tuple[dict, bool]:
    """The engine request of one side of a problem: greedy (n=1, T=0) or the N-sample batch; sample i of
    the batch uses seed + i (the engine's `n` semantics), as in `laneplay eval`."""
    prompt, _ = prompt_of(problem, config.mode)
    return remote_request_body(prompt, n, temperature, config.seed, max_tokens or config.max_tokens, config.top_p,
                               model)


@dataclass
class Reply:
    texts: list[str]
    ms: float  # wall time of the request, as the app saw it
    ttft_ms: float | None
    step_ms: float | None  # decode step time of the batch (server's timing when it sends it)
    tokens: list[int]  # per choice


def reply_of(g: Generation) -> Reply:
    """A finished request's texts and timing: each choice's as its meter ends with it (the engine's timing
    when it sent it, else the app's), the batch's step time its slowest choice's."""
    cols = g.columns
    steps = [c.meter.ms_per_token for c in cols if c.meter.ms_per_token]
    ttfts = [c.meter.ttft_ms for c in cols if c.meter.ttft_ms is not None]
    return Reply([c.text for c in cols], g.timer.elapsed_ms(), min(ttfts) if ttfts else None,
                 max(steps) if steps else None, [int(c.meter.tokens or 0) for c in cols])


def extract(problem: Problem, mode: str, text: str):
    return extract_code(problem, text) if mode == "instruct" else extract_completion(problem, text)


class JobManager:
    def __init__(self, store, engine, *, max_running: int = PASSN_RUNNING, max_active: int = PASSN_ACTIVE,
                 max_per_address: int = PASSN_ACTIVE_PER_ADDRESS):
        self.store, self.engine = store, engine
        self.max_running, self.max_active, self.max_per_address = max_running, max_active, max_per_address
        self._jobs: dict[str, _Job] = {}
        self._slots: asyncio.Semaphore | None = None

    # -- starting, cancelling, following ---------------------------------------------------------

    def active_run(self, owner: str) -> str | None:
        return next((j.id for j in self._jobs.values() if j.owner == owner), None)

    def admit(self, owner: str, address: str) -> None:
        """Raises Busy when `owner` (from `address`) may not start a run now."""
        if self.active_run(owner) is not None:
            raise Busy("You already have a pass@N run going; wait for it or cancel it first.")
        from_here = sum(j.address == address for j in self._jobs.values())
        if from_here >= self.max_per_address:
            raise Busy(f"{from_here} pass@N runs from your address are queued or running, the most one address "
                       f"may have of the server's {self.max_active}. Wait for one to finish.")
        if len(self._jobs) >= self.max_active:
            raise Busy(f"The server is busy: {len(self._jobs)} pass@N runs are queued or running. "
                       "Try again in a few minutes.")

    async def start(self, *, owner: str, session_id: str, problems: list[Problem], problem_set: str,
                    config: RunConfig, model: str = "", address: str = "local") -> str:
        """Stores the run and starts its job; returns the run (comparison) id."""
        config.validate(self.engine.info)
        if not problems:
            raise RunInputError("Choose at least one problem.")
        if len(problems) > MAX_RUN_PROBLEMS:
            raise RunInputError(f"{len(problems)} problems chosen; one run takes at most {MAX_RUN_PROBLEMS} "
                                "(use `laneplay eval` for a whole benchmark).")
        ok, why = sandbox_status()
        if not ok:
            raise SandboxMissing(f"The sandbox is unavailable, so pass@N cannot run generated code: {why}")
        self.admit(owner, address)
        user = [p for p in problems if p.source == "user"]
        settings = {"top_p": config.top_p, "max_tokens": config.max_tokens, "seed": config.seed,
                    "mode": config.mode, "timeout_s": config.timeout_s,
                    "engine": str((self.engine.info or {}).get("model") or model or "")[:200]}
        if user:
            settings.update(prompt=user[0].prompt, entry_point=user[0].entry_point)
        cid = self.store.create_comparison(
            problem_set=problem_set, problem_ids=[p.task_id for p in problems], n=config.n,
            temperature=config.temperature, greedy=True, session_id=session_id, model=settings["engine"],
            tests=[p.test for p in user] or None, status="queued" if len(self._jobs) >= self.max_running else "running",
            settings=settings, owner=owner)
        job = _Job(cid, owner, address, list(problems), config)
        self._jobs[cid] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"pass@N {cid}")
        return cid

    def cancel(self, run_id: str, owner: str | None) -> bool:
        """Cancels a queued or running job of `owner`; what finished stays stored."""
        job = self._jobs.get(run_id)
        if job is None or job.owner != owner:
            return False
        job.phase = "cancelling"
        if job.task is not None:
            job.task.cancel()
        return True

    def live(self, run_id: str) -> dict | None:
        """What only the running process knows about a run: phase, elapsed, queue position."""
        job = self._jobs.get(run_id)
        if job is None:
            return None
        waiting = [j for j in self._jobs.values() if j.started is None]
        position = waiting.index(job) + 1 if job in waiting else None
        now = time.monotonic()
        return {"phase": job.phase, "queue_position": position,
                "elapsed_s": (now - job.started) if job.started else 0.0, "waited_s": now - job.created}

    async def shutdown(self) -> None:
        """The server is stopping: running jobs end as interrupted, with what they finished."""
        jobs = list(self._jobs.values())
        for j in jobs:
            if j.task is not None:
                j.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)
        for j in jobs:
            self._set_status(j, "interrupted", "the server stopped during the run")

    # -- the job ---------------------------------------------------------------------------------

    def _set_status(self, job: _Job, status: str, error: str | None = None) -> None:
        try:
            self.store.set_run_status(job.id, status, error, owner=job.owner)
        except Exception:  # noqa: BLE001 (a deleted session takes its runs with it)
            log.warning("could not mark run %s %s", job.id, status, exc_info=True)

    async def _run(self, job: _Job) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        status, error = "done", None
        try:
            async with self._slots:
                job.started, job.phase = time.monotonic(), "starting"
                self._set_status(job, "running")
                await self._work(job)
        except asyncio.CancelledError:
            status = "interrupted" if job.phase != "cancelling" else "cancelled"
            error = None if status == "cancelled" else "the server stopped during the run"
        except SandboxMissing as e:
            status, error = "error", str(e)
        except EngineError as e:
            status, error = "error", e.message
        except Exception as e:  # noqa: BLE001 (the run ends as an error with its reason; the server lives on)
            log.exception("pass@N run %s failed", job.id)
            status, error = "error", f"{type(e).__name__}: {e}"
        finally:
            self._jobs.pop(job.id, None)
        if status != "done":
            self._set_status(job, status, error)

    def client(self) -> EngineClient:
        return EngineClient(self.engine.url, api_key=self.engine.api_key)

    async def _wait_engine(self, job: _Job) -> None:
        async for _ in engine_ready(self.engine):
            job.phase = f"waiting for the engine ({self.engine.state})"

    async def _request(self, job: _Job, body: dict, chat: bool, n: int) -> Reply:
        """A request with the engine's own back-pressure respected: a restarting engine is waited for,
        a busy one (429) is retried after the time it names."""
        for attempt in range(BUSY_RETRIES + 1):
            await self._wait_engine(job)
            if (getattr(self.engine, "info", None) or {}).get("laneplay"):  # batch work on a Laneplay engine:
                body = {**body, "laneplay": {"priority": "batch"}}  # the Playground's requests go first
            try:
                return reply_of(await collect(self, body, chat, n))
            except EngineError as e:
                if attempt == BUSY_RETRIES or e.kind not in ("busy", "unreachable"):
                    raise
                await asyncio.sleep(min(max(e.retry_after or 1.0, 0.5), 10.0))
        raise AssertionError("unreachable")

    async def _calibrate(self, job: _Job) -> None:
        """The decode step time at each batch size k <= N, on this engine, now (for the cost per k): the
        faster of two short requests per k, so one hiccup of a shared machine does not stand for k."""
        step_ms = {}
        for k in [k for k in KS if k <= job.config.n]:
            job.phase = f"measuring the step time at batch {k}"
            body, chat = request_body(job.problems[0], job.config, k, job.config.temperature,
                                      max_tokens=CALIBRATION_TOKENS)
            steps = [r.step_ms for r in [await self._request(job, body, chat, k) for _ in range(2)] if r.step_ms]
            if steps:
                step_ms[str(k)] = round(min(steps), 3)
        if step_ms:
            self.store.update_run_settings(job.id, {"step_ms": step_ms}, owner=job.owner)

    async def _work(self, job: _Job) -> None:
        cfg = job.config
        await self._calibrate(job)
        checks: list[asyncio.Task] = []
        try:
            for i, problem in enumerate(job.problems):
                job.phase = f"generating {problem.task_id} ({i + 1}/{len(job.problems)})"
                body, chat = request_body(problem, cfg, 1, 0.0)
                greedy = await self._request(job, body, chat, 1)
                body, chat = request_body(problem, cfg, cfg.n, cfg.temperature)
                batch = await self._request(job, body, chat, cfg.n)
                self.store.set_problem_timing(job.id, problem.task_id, {
                    "greedy_ms": greedy.ms, "greedy_ttft_ms": greedy.ttft_ms, "greedy_step_ms": greedy.step_ms,
                    "greedy_tokens": max(greedy.tokens, default=0), "batch_ms": batch.ms,
                    "batch_ttft_ms": batch.ttft_ms, "batch_step_ms": batch.step_ms,
                    "batch_tokens": max(batch.tokens, default=0)}, owner=job.owner)
                sides = [(True, 0, greedy.texts[0], greedy.tokens[0], greedy.ms)]
                sides += [(False, j, t, batch.tokens[j], batch.ms) for j, t in enumerate(batch.texts)]
                checks += [asyncio.create_task(self._check(job, problem, *side)) for side in sides]
            job.phase = "checking the last samples"
            await asyncio.gather(*checks)
        except BaseException:
            for t in checks:
                t.cancel()
            raise
        self._finish(job)

    async def _check(self, job: _Job, problem: Problem, greedy: bool, index: int, text: str, tokens: int,
                     ms: float) -> None:
        ex = extract(problem, job.config.mode, text)
        if ex.code.strip():
            out = await check_code(problem, ex.code, timeout_s=job.config.timeout_s)
            status, error, seconds = out.status, out.error, out.seconds
        else:
            status, error, seconds = "error", "; ".join(ex.warnings) or "no code in the answer", 0.0
        self.store.add_sample_results(job.id, [{
            "problem_id": problem.task_id, "greedy": greedy, "sample_index": index, "status": status,
            "error": error or None, "runtime_s": seconds, "completion_tokens": tokens, "generation_ms": ms,
            "code": ex.code or text}], owner=job.owner)
        job.checked += 1

    def _finish(self, job: _Job) -> None:
        run = self.store.get_comparison(job.id, owner=job.owner)
        if run is None:  # the owner deleted the session (and the run with it) meanwhile
            return
        summary = summarize(run)
        self.store.set_passk(job.id, summary["passk"], owner=job.owner, greedy_pass1=summary["greedy_pass1"],
                             greedy_seconds=summary["greedy_seconds"], sampled_seconds=summary["sampled_seconds"])


def summarize(run: dict) -> dict:
    """pass@k (unbiased, mean over the problems whose N samples are all checked), greedy pass@1, the
    outcome counts, and the timing totals: from the stored results alone, so an interrupted run's partial
    results read the same way as a finished run's."""
    n = run["n"]
    by_problem: dict[str, list[dict]] = {p: [] for p in run["problem_ids"]}
    greedy: dict[str, dict] = {}
    for r in run["results"]:
        if r["greedy"]:
            greedy[r["problem_id"]] = r
        else:
            by_problem[r["problem_id"]].append(r)
    complete = [p for p, rs in by_problem.items() if len(rs) == n and n > 0]
    pools = [(n, sum(r["status"] == "pass" for r in by_problem[p])) for p in complete]
    timing = run.get("timing") or {}
    return {
        "passk": mean_pass_at_ks(pools, KS) if pools else {},
        "problems_complete": len(complete),
        "greedy_pass1": (sum(g["status"] == "pass" for g in greedy.values()) / len(greedy)) if greedy else None,
        "greedy_done": len(greedy),
        "statuses": count_statuses(r["status"] for rs in by_problem.values() for r in rs),
        "greedy_statuses": count_statuses(g["status"] for g in greedy.values()),
        "greedy_seconds": sum(t.get("greedy_ms", 0.0) for t in timing.values()) / 1000 if timing else None,
        "sampled_seconds": sum(t.get("batch_ms", 0.0) for t in timing.values()) / 1000 if timing else None,
    }


def cost_per_k(run: dict) -> list[dict]:
    """The latency cost of drawing k samples, per problem, next to the greedy call. k = N is the measured
    batch; k < N is the same decode (the batch's TTFT and its longest sample's steps) at the step time
    measured at batch k when the run started. Empty until a problem has its timing."""
    timing = [t for t in (run.get("timing") or {}).values() if "batch_ms" in t and "greedy_ms" in t]
    if not timing:
        return []
    greedy_ms = sum(t["greedy_ms"] for t in timing) / len(timing)
    batch_ms = sum(t["batch_ms"] for t in timing) / len(timing)
    ttft = sum(t.get("batch_ttft_ms") or 0.0 for t in timing) / len(timing)
    steps = sum(max(t.get("batch_tokens", 1) - 1, 0) for t in timing) / len(timing)
    step_ms = (run.get("settings") or {}).get("step_ms") or {}
    rows = []
    for k in [k for k in KS if k <= run["n"]]:
        if k == run["n"]:
            ms, how = batch_ms, "measured"
        elif str(k) in step_ms:
            ms, how = ttft + steps * step_ms[str(k)], "from the step time at batch %d" % k
        else:
            continue
        rows.append({"k": k, "ms": ms, "vs_greedy": ms / greedy_ms if greedy_ms > 0 else None, "how": how})
    return rows
