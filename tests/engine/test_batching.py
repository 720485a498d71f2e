"""Iteration-level batching: separate requests share decode steps, and each gets the tokens it gets alone.

The scheduler is driven directly (no HTTP): requests are submitted on an event loop, the worker runs
them as rows of one batch, and every request's tokens are compared with the same request run alone
through `Engine.generate`.
"""
import asyncio
import threading

import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.scheduler import STARTED, Queued, Scheduler

PROMPTS = ["def fib(n):\n", "# Sort a list of numbers in place.\ndef sort(xs):\n", "class Stack:\n    def push(",
           "import os\n\n\ndef walk(path):\n    \"\"\"Yield every file under path.\"\"\"\n"]


@pytest.fixture(scope="module")
def int4_engine():
    from laneplay.kernels import lowbit

    if not lowbit.available():
        pytest.skip("the low-bit kernels are not built")
    return load_engine("smollm2-135m-instruct", dtype="int4")


def alone(engine, prompt, params: SamplingParams) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in engine.generate(prompt, params):
        out.setdefault(ev.sample_index, []).extend(ev.token_ids)
    return out


async def _collect(job):
    out: dict[int, list[int]] = {}
    reasons = {}
    async for ev in job.stream():
        if ev is STARTED or isinstance(ev, Queued):
            continue
        out.setdefault(ev.sample_index, []).extend(ev.token_ids)
        if ev.finish_reason:
            reasons[ev.sample_index] = ev.finish_reason
    return out, reasons


def run_together(engine, requests, scheduler_kw=None, between=None):
    """Submit (prompt, params[, priority]) requests together; returns [(tokens, reasons, job)]."""
    async def main():
        sched = Scheduler(engine, **(scheduler_kw or {}))
        sched.start()
        try:
            jobs = []
            for req in requests:
                prompt, params, *rest = req
                ids, params = engine.prepare(prompt, params)
                jobs.append(sched.submit(ids, params, priority=rest[0] if rest else "interactive"))
                if between is not None:
                    await between(sched, jobs)
            results = await asyncio.gather(*(_collect(j) for j in jobs))
            return [(toks, reasons, job) for (toks, reasons), job in zip(results, jobs)]
        finally:
            sched.close()
    return asyncio.run(main())


def mixed_requests():
    """Greedy and seeded sampling, one and several samples, stop strings, different lengths."""
    return [
        (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0)),
        (PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, n=3)),
        (PROMPTS[2], SamplingParams(max_tokens=32, temperature=0.7, top_k=40, seed=5, stop=["\n\n"])),
        (PROMPTS[3] * 6, SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, seed=3, n=2)),
    ]


def test_low_bit_rows_give_the_tokens_they_give_alone_bit_for_bit(int4_engine):
    eng = int4_engine
    assert Scheduler(eng).batched
    got = run_together(eng, mixed_requests())
    shared = 0
    for (prompt, params), (tokens, reasons, job) in zip(mixed_requests(), got):
        assert job.outcome == "completed"
        assert tokens == alone(eng, prompt, params), f"{prompt!r} changed in the batch"
        assert set(reasons) == set(range(params.n))
        shared = max(shared, job.rows_per_step or 0)
    assert shared > 3  # they did share steps (the four requests hold 7 rows)


def test_a_request_joining_a_running_one_changes_neither(int4_engine):
    eng = int4_engine
    long = (PROMPTS[1], SamplingParams(max_tokens=60, temperature=0.8, seed=1, ignore_eos=True))
    late = (PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))

    async def wait_until_decoding(sched, jobs):
        if len(jobs) == 1:  # the second arrives while the first is well into its decode
            while jobs[0].steps < 10:
                await asyncio.sleep(0.005)

    (t_long, _, j_long), (t_late, _, j_late) = run_together(eng, [long, late], between=wait_until_decoding)
    assert t_long == alone(eng, *long) and t_late == alone(eng, *late)
    assert j_late.queue_ms < 1000 and j_late.sharing == 1  # it joined at a step boundary, not after the first
    assert j_late.start_seq == 2 and j_long.outcome == j_late.outcome == "completed"


def test_float_rows_agree_with_alone_within_rounding(tmp_path):
    """A float model with several lanes, sliding-window layers and delayed reduces: decode_groups at
    different positions and caches equals each sequence's own decode within float32 rounding."""
    raw = tiny_laneformer_config(sliding_window=8)
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=0))
    eng = load_engine(tmp_path / "ckpt", compile=False)
    model = eng.model
    gen = torch.Generator().manual_seed(2)
    lengths, rows = [5, 13, 20], [1, 2, 1]  # positions past the window (8): the rings have wrapped
    ids = [torch.randint(0, raw["vocab_size"], (1, n), generator=gen) for n in lengths]
    caches_a, caches_b = [], []
    for x, r in zip(ids, rows):
        for caches in (caches_a, caches_b):
            caches.append(model.prefill(x, r, 40)[1])
    for step in range(4):
        tokens = torch.randint(0, raw["vocab_size"], (sum(rows), 1), generator=gen)
        together = model.decode_groups(tokens, [(n + step, c) for n, c in zip(lengths, caches_a)])
        a = 0
        for n, r, c in zip(lengths, rows, caches_b):
            own = model.decode(tokens[a:a + r], n + step, c)
            assert (together[a:a + r] - own).abs().max() <= 1e-5 * own.abs().max()
            a += r
    # and the tokens of whole requests, greedy, through the scheduler
    reqs = [([int(t) for t in x[0]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for x in ids]
    for (prompt, params), (tokens, _, _) in zip(reqs, run_together(eng, reqs)):
        assert tokens == alone(eng, prompt, params)


def test_interactive_requests_join_before_batch_ones(int4_engine):
    """Two rows per step, one of them kept for interactive work: a batch request waits while an
    interactive one runs, and an interactive request that arrives after it still starts first."""
    eng = int4_engine
    first = (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    batch = (PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0), "batch")
    later = (PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0))

    async def hold(sched, jobs):
        if len(jobs) == 1:
            while not jobs[0].steps:
                await asyncio.sleep(0.005)
        if len(jobs) == 2:
            await asyncio.sleep(0.05)
            assert sched.position(jobs[1]) == 1  # batch work does not take the interactive row

    got = run_together(eng, [first, batch, later], {"max_rows": 2, "interactive_reserve": 1}, between=hold)
    (_, _, j_first), (t_batch, _, j_batch), (t_later, _, j_later) = got
    assert j_later.start_seq < j_batch.start_seq and j_later.seq > j_batch.seq
    assert j_batch.priority == "batch" and t_batch == alone(eng, *batch[:2]) and t_later == alone(eng, *later)


def test_a_request_waits_for_kv_memory_instead_of_failing(int4_engine):
    """The running requests' KV caches together stay within the budget: one that does not fit now
    waits with its place in line and runs when memory frees."""
    from laneplay.engine.batch import kv_need

    eng = int4_engine
    reqs = [(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0)),
            (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0))]
    needs = [kv_need(eng, eng.prepare(p, s)[0], s) for p, s in reqs]
    sched_kw = {"max_rows": 16}

    async def squeeze(sched, jobs):
        sched.kv_budget = max(needs) + min(needs) // 2  # room for one at a time

    got = run_together(eng, reqs, sched_kw, between=squeeze)
    (t0, _, j0), (t1, _, j1) = got
    assert j0.outcome == j1.outcome == "completed"
    assert j0.rows_per_step == j1.rows_per_step == 1  # one after the other, never in the same step
    assert t0 == alone(eng, *reqs[0]) and t1 == alone(eng, *reqs[1])


def test_a_cancelled_row_leaves_and_the_others_go_on(int4_engine):
    eng = int4_engine
    keep = (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    drop = (PROMPTS[1], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))

    async def cancel_soon(sched, jobs):
        if len(jobs) == 2:
            async def later():
                while jobs[1].steps < 3:
                    await asyncio.sleep(0.005)
                sched.cancel(jobs[1])
            asyncio.get_running_loop().create_task(later())

    (t_keep, _, j_keep), (t_drop, reasons, j_drop) = run_together(eng, [keep, drop], between=cancel_soon)
    assert j_drop.outcome == "cancelled" and reasons == {0: "cancelled"} and len(t_drop[0]) < 50
    assert j_keep.outcome == "completed" and t_keep == alone(eng, *keep)


def test_an_engine_failure_ends_the_batch_not_the_worker(int4_engine):
    eng = int4_engine
    sched = Scheduler(eng)
    real = eng.runner.decode_groups
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(tokens, groups):
        with lock:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the device fell over")
        return real(tokens, groups)

    async def main():
        sched.start()
        try:
            eng.runner.decode_groups = flaky
            ids, params = eng.prepare(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
            job = sched.submit(ids, params)
            with pytest.raises(RuntimeError, match="fell over"):
                await _collect(job)
            del eng.runner.decode_groups
            again = sched.submit(ids, params)
            return job, again, await _collect(again)
        finally:
            sched.close()

    job, again, (tokens, _) = asyncio.run(main())
    assert job.outcome == "error" and again.outcome == "completed"
    assert tokens == alone(eng, PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


CODE = """def parse_config(path):
    \"\"\"Read a key=value file into a dict, skipping blank lines and comments.\"\"\"
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result


def merge_configs(*paths):
    merged = {}
    for p in paths:
        merged.update(parse_config(p))
    return merged
"""


def test_a_prompt_that_begins_like_a_recent_one_reuses_its_prefix_exactly():
    """The same code with a new instruction: the second request starts its prefill after the whole
    chunks it shares with the first, and gets the tokens a cold prefill gives."""
    from laneplay.kernels import lowbit

    eng = load_engine("smollm2-135m-instruct", dtype="int4" if lowbit.available() else "float32", prefill_chunk=32)
    first = (CODE + "\n# Add type hints to parse_config.\n", SamplingParams(max_tokens=12, temperature=0.0))
    second = (CODE + "\n# Write a docstring for merge_configs.\n", SamplingParams(max_tokens=12, temperature=0.0))
    sampled = (CODE + "\n# Explain merge_configs.\n", SamplingParams(max_tokens=12, temperature=0.8, seed=4, n=2))
    (t1, _, j1), (t2, _, j2), (t3, _, j3) = run_together(eng, [first, second, sampled], {"max_rows": 1})
    shared = len(eng.tokenizer.encode(CODE)) - 2  # the last tokens of the code may merge with what follows
    assert j1.cached_tokens == 0
    assert j2.cached_tokens >= shared // 32 * 32 - 32 and j2.cached_tokens % 32 == 0 and j2.cached_tokens > 0
    assert j3.cached_tokens == j2.cached_tokens
    assert t1 == alone(eng, *first) and t2 == alone(eng, *second) and t3 == alone(eng, *sampled)


def test_a_reused_prefix_on_sliding_window_layers_is_exact(tmp_path):
    """Ring buffers: the prefix is copied into the new cache's own slots (its window may wrap
    differently), and the logits equal a cold prefill's bit for bit."""
    from laneplay.engine.batch import PrefixCache

    raw = tiny_laneformer_config(sliding_window=8)
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=1))
    eng = load_engine(tmp_path / "ckpt", compile=False, prefill_chunk=4)
    runner, gen = eng.runner, torch.Generator().manual_seed(3)
    base = torch.randint(0, raw["vocab_size"], (30,), generator=gen).tolist()
    prefixes = PrefixCache(chunk=4, max_bytes=2**30)

    def run(ids, max_seq_len):
        steps, reused = runner.prefill_steps(ids, 1, max_seq_len, prefixes)
        for out in steps:
            if out is not None:
                return out, reused

    run(base, 64)
    assert len(prefixes) == 1
    for tail, max_seq_len in [([1, 2, 3], 40), ([5] * 9, 64), ([7], 36)]:
        ids = base[:22] + tail
        (logits, cache), reused = run(ids, max_seq_len)
        cold_logits, cold_cache = eng.model.prefill(torch.tensor([ids]), 1, max_seq_len, chunk=4)
        assert reused == 20
        assert torch.equal(logits, cold_logits)
        for a, b in zip(cache.k + cache.v, cold_cache.k + cold_cache.v):
            assert torch.equal(a, b)


def test_the_prefix_cache_stays_within_its_bytes_and_drops_the_least_recent():
    from laneplay.engine.batch import PrefixCache
    from laneplay.engine.model import KVPrefix

    def prefix(end, nbytes):
        out = KVPrefix(1)
        out.end, out.pos = end, [torch.arange(end)]
        out.k = out.v = [torch.zeros(1, 1, end, nbytes // 8 // end)]
        return out

    cache = PrefixCache(chunk=4, max_bytes=1100)
    cache.store([1, 2, 3, 4], prefix(4, 512))
    cache.store([9, 9, 9, 9], prefix(4, 512))
    assert cache.lookup([1, 2, 3, 4, 5], [64]) is not None  # touch the first: the second is now the oldest
    cache.store([5, 5, 5, 5], prefix(4, 512))
    assert len(cache) == 2 and cache.bytes == 1024
    assert cache.lookup([9, 9, 9, 9, 1], [64]) is None and cache.lookup([1, 2, 3, 4, 1], [64]) is not None
    assert cache.lookup([1, 2, 3, 4], [64]) is None  # the prompt's last token is always computed
    cache.store([1, 2, 3, 4, 6, 6, 6, 6], prefix(8, 512))  # the longer prompt replaces the one it begins with
    assert len(cache) == 2 and cache.lookup([1, 2, 3, 4, 6, 6, 6, 6, 0], [64])[1] == 8
    cache.shrink(0)
    assert len(cache) == 0 and cache.bytes == 0


def test_a_prompt_that_fails_ends_alone_and_the_running_rows_go_on(int4_engine):
    """An allocation failure in one request's prefill ends that request with an error; the request
    already decoding beside it finishes with its own tokens."""
    eng = int4_engine
    keep = (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    bad = (PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0))
    real = eng.runner.prefill_steps

    def prefill_steps(ids, *args, **kwargs):
        steps, reused = real(ids, *args, **kwargs)
        if ids != eng.prepare(*bad)[0]:
            return steps, reused

        def failing():
            raise MemoryError("no memory for this prompt's cache")
            yield
        return failing(), reused

    got = {}

    async def main():
        sched = Scheduler(eng)
        sched.start()
        eng.runner.prefill_steps = prefill_steps
        try:
            first = sched.submit(*eng.prepare(*keep))
            while first.steps < 3:
                await asyncio.sleep(0.005)
            second = sched.submit(*eng.prepare(*bad))
            got["keep"] = await _collect(first)
            with pytest.raises(MemoryError):
                await _collect(second)
            return first, second
        finally:
            del eng.runner.prefill_steps
            sched.close()

    first, second = asyncio.run(main())
    assert second.outcome == "error" and first.outcome == "completed"
    assert got["keep"][0] == alone(eng, *keep)


@pytest.mark.parametrize("shared_rows", [4, 16])
def test_batch_work_waits_out_the_steps_an_interactive_request_needs(int4_engine, shared_rows):
    """A pass@N-like batch request (4 samples) is decoding when a Playground request arrives: with the
    default of 4 rows per shared step the batch rows wait while the interactive one decodes (it runs
    alone, at its own speed), and resume exactly where they were; with room for them, they share."""
    eng = int4_engine
    batch = (PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.9, seed=2, n=4, ignore_eos=True), "batch")
    inter = (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))

    async def when_batch_decodes(sched, jobs):
        if len(jobs) == 1:
            while jobs[0].steps < 3:
                await asyncio.sleep(0.005)

    got = run_together(eng, [batch, inter], {"shared_rows": shared_rows}, between=when_batch_decodes)
    (t_batch, _, j_batch), (t_inter, _, j_inter) = got
    assert t_batch == alone(eng, *batch[:2]) and t_inter == alone(eng, *inter)
    if shared_rows == 4:
        assert j_inter.rows_per_step == 1 and j_batch.outcome == "completed"
    else:
        assert j_inter.rows_per_step == 5


def test_a_waiting_request_hears_its_place_in_line_move(int4_engine):
    """One row per step: the third request waits behind two; as they start it hears 2, then 1."""
    eng = int4_engine

    async def main():
        sched = Scheduler(eng, max_rows=1)
        sched.start()
        try:
            jobs = [sched.submit(*eng.prepare(p, SamplingParams(max_tokens=6, temperature=0.0))) for p in PROMPTS[:3]]
            heard = []
            async for ev in jobs[2].stream():
                if isinstance(ev, Queued):
                    heard.append(ev.position)
                elif ev is STARTED:
                    heard.append("started")
            for j in jobs[:2]:
                await _collect(j)
            return heard
        finally:
            sched.close()

    heard = asyncio.run(main())
    assert heard[-1] == "started" and heard[:-1] and heard[:-1][-1] == 1
    assert heard[:-1] == sorted(heard[:-1], reverse=True)  # it only ever moves up


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_long_prompt_joining_takes_at_most_its_share_of_the_time(int4_engine, share):
    """A request decodes while a 3-chunk prompt joins. With prefill_share 1 the chunks run one per step
    (the decoding request gets one token per chunk); with 1/2 the decoding request steps for as long as
    each chunk took before the next one runs (a step is far shorter than a chunk: many tokens per
    chunk). Either way both get the tokens they get alone."""
    eng = int4_engine
    chunk = eng.runtime.prefill_chunk
    long_ids = (eng.tokenizer.encode(PROMPTS[3]) * 200)[:3 * chunk - 5]
    streamer = (PROMPTS[0], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    joiner = (long_ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    seen = {}

    async def when_streaming(sched, jobs):
        if len(jobs) == 1:
            while jobs[0].steps < 2:
                await asyncio.sleep(0.002)
            seen["before"] = jobs[0].steps
        else:  # the joiner's first decode step: its prompt is done
            async def watch():
                while jobs[1].steps < 1:
                    await asyncio.sleep(0.001)
                seen["after"] = jobs[0].steps
            seen["task"] = asyncio.ensure_future(watch())

    got = run_together(eng, [streamer, joiner], {"prefill_share": share}, between=when_streaming)
    during = seen["after"] - seen["before"]
    if share == 1.0:
        assert during <= 3 + 2, during  # one step per chunk (and the step after the last)
    else:
        assert during >= 3 * 3, during
    assert got[0][0] == alone(eng, *streamer) and got[1][0] == alone(eng, *joiner)
    with pytest.raises(ValueError, match="prefill_share"):
        Scheduler(eng, prefill_share=0)


def test_events_cross_to_the_loop_in_order_with_one_wake_up_for_a_steps_worth():
    """The worker's events reach each job's queue in order; those that arrive before the loop runs share one
    wake-up; a closed loop cancels the job instead of raising in the worker."""
    from laneplay.engine.scheduler import Job

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job([1], SamplingParams(), loop, seq=i) for i in range(3)]
        wakes = []
        real = loop.call_soon_threadsafe

        def counted(cb, *args):
            wakes.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counted
        def worker():
            for step in range(5):
                for j in jobs:
                    j.push((j.seq, step))

        t = threading.Thread(target=worker)
        t.start()
        t.join()  # the loop runs nothing meanwhile: every event arrives before it can
        got = [[await asyncio.wait_for(j.events.get(), 5) for _ in range(5)] for j in jobs]
        assert got == [[(j.seq, s) for s in range(5)] for j in jobs]
        assert len(wakes) == 1
        for j in jobs:
            j.push("again")
        assert [await j.events.get() for j in jobs] == ["again"] * 3 and len(wakes) == 2
        return jobs[0]

    loop = asyncio.new_event_loop()
    job = loop.run_until_complete(main())
    loop.close()
    job.push("late")  # the loop is gone: nobody listens any more
    assert job.cancelled


def test_a_batch_prompt_runs_in_pieces_and_an_interactive_prompt_goes_first(int4_engine, monkeypatch):
    """A batch request's long prompt runs on the fused step in pieces of BATCH_PIECE positions, a step each;
    an interactive request arriving meanwhile has its prompt run at the next step, before the batch prompt's
    remaining pieces, and both get the tokens they get alone."""
    from laneplay.engine import scheduler as sched_mod

    eng = int4_engine
    model = eng.runner.model
    calls = []
    groups = model.fused_step.groups
    monkeypatch.setattr(model.fused_step, "groups",
                        lambda tokens, grp, last_only=False: calls.append((len(grp), last_only, grp[-1][1]))
                        or groups(tokens, grp, last_only))
    batch = (PROMPTS[3] * 10, SamplingParams(max_tokens=4, temperature=0.0), "batch")
    later = (PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))

    async def hold(sched, jobs):
        if len(jobs) == 1:
            while not calls:  # the batch prompt's first piece ran
                await asyncio.sleep(0.001)

    got = run_together(eng, [batch, later], between=hold)
    (t_batch, _, j_batch), (t_later, _, j_later) = got
    prompts = [c for c in calls if c[1]]  # prompt pieces: last-row logits only
    caches = [c[2] for c in prompts]
    batch_cache = caches[0]
    n_batch = len(eng.prepare(*batch[:2])[0])
    assert all(rows <= sched_mod.BATCH_PIECE for rows, _, c in prompts if c is batch_cache)
    assert sum(rows for rows, _, c in prompts if c is batch_cache) == n_batch
    first_other = next(i for i, c in enumerate(caches) if c is not batch_cache)
    assert any(c is batch_cache for c in caches[first_other + 1:])  # the interactive prompt cut in
    assert t_batch == alone(eng, *batch[:2]) and t_later == alone(eng, *later)
