"""pass@N runs as jobs, against a scripted OpenAI-compatible engine: the run's stored results and pass@k,
its bounds (one per owner, a global cap, a queue), cancel, and a server killed mid-run."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from laneplay.app import checks
from laneplay.app.jobs import Busy, JobManager, RunConfig, RunInputError, cost_per_k, summarize
from laneplay.evals.passk import mean_pass_at_ks
from laneplay.evals.problems import user_problem
from laneplay.storage import OPERATOR, Store

from .serving import serve

RIGHT = {"add": "a + b", "mul": "a * b"}
DELAY = {"s": 0.0}  # seconds between streamed chunks


def fake_engine() -> FastAPI:
    """Answers chat requests with a fenced function: right for greedy (T=0) and for even seeds, wrong
    (a minus sign) for odd ones; sample i of a request has seed + i, as the real engine."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        name = re.search(r"def (\w+)", body["messages"][-1]["content"])[1]
        n, seed, temp = body.get("n", 1), body.get("seed") or 0, body.get("temperature", 1.0)

        def answer(i):
            good = temp == 0 or (seed + i) % 2 == 0
            return ["```python\n", f"def {name}(a, b):\n", f"    return {RIGHT[name] if good else 'a - b'}\n", "```"]

        async def events():
            parts = [answer(i) for i in range(n)]
            for step in range(4):
                await asyncio.sleep(DELAY["s"])
                for i in range(n):
                    chunk = {"choices": [{"index": i, "delta": {"content": parts[i][step]}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            for i in range(n):
                yield f'data: {{"choices":[{{"index":{i},"delta":{{}},"finish_reason":"stop"}}]}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class StubEngine:
    ready, state, detail, api_key = True, "ready", "", None
    info = {"model": "scripted", "laneplay": False}

    def __init__(self, url):
        self.url = url


@pytest.fixture(scope="module")
def url():
    with serve(fake_engine()) as base:
        yield base


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'runs.db'}")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def fast():
    DELAY["s"] = 0.0
    yield
    DELAY["s"] = 0.0


OWNER, OTHER = "o" * 40, "p" * 40


def problems():
    return [user_problem("def add(a, b):\n", "assert add(1, 2) == 3\nassert add(2, 2) == 4", task_id="user/add"),
            user_problem("def mul(a, b):\n", "assert mul(2, 3) == 6", task_id="user/mul")]


async def wait_run(store, cid, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = store.get_comparison(cid, owner=OPERATOR)
        if run["status"] not in ("queued", "running"):
            return run
        await asyncio.sleep(0.05)
    raise AssertionError(f"run still {store.get_comparison(cid, owner=OPERATOR)['status']}")


def test_a_run_stores_every_sample_and_the_unbiased_pass_at_k(url, store):
    async def go():
        jobs = JobManager(store, StubEngine(url))
        sid = store.create_session(title="t", owner=OWNER)
        cid = await jobs.start(owner=OWNER, session_id=sid, problems=problems(), problem_set="user",
                               config=RunConfig(n=4, temperature=0.8, seed=3))
        return await wait_run(store, cid)

    run = asyncio.run(go())
    assert run["status"] == "done" and run["error"] is None
    assert len(run["results"]) == 2 * (4 + 1)
    # seeds 3..6: 4 and 6 are even, so 2 of 4 samples pass on each problem; greedy always passes
    samples = [r for r in run["results"] if not r["greedy"]]
    assert [r["status"] for r in samples] == ["fail", "pass", "fail", "pass"] * 2
    assert all(r["code"].startswith("def ") and "return" in r["code"] for r in run["results"])
    fail = next(r for r in samples if r["status"] == "fail")
    assert "AssertionError" in fail["error"]
    expect = mean_pass_at_ks([(4, 2), (4, 2)])
    assert {p["k"]: p["value"] for p in run["passk"]} == pytest.approx(expect)
    assert run["greedy_pass1"] == 1.0
    assert set(run["timing"]) == {"user/add", "user/mul"}
    assert set(run["settings"]["step_ms"]) == {"1", "2", "4"}
    assert run["settings"]["prompt"] == "def add(a, b):\n" and run["tests"][0].startswith("assert add")
    s = summarize(run)
    assert s["passk"] == pytest.approx(expect) and s["statuses"]["pass"] == 4 and s["problems_complete"] == 2
    costs = cost_per_k(run)
    assert [c["k"] for c in costs] == [1, 2, 4] and costs[-1]["how"] == "measured"
    assert all(c["ms"] > 0 and c["vs_greedy"] > 0 for c in costs)


def test_one_run_per_owner_a_global_cap_and_a_queue(url, store):
    async def go():
        DELAY["s"] = 0.2
        jobs = JobManager(store, StubEngine(url), max_running=1, max_active=2)
        sids = [store.create_session(title="t", owner=o) for o in (OWNER, OTHER, "q" * 40)]
        config = RunConfig(n=1, temperature=0.5)
        first = await jobs.start(owner=OWNER, session_id=sids[0], problems=problems()[:1], problem_set="user",
                                 config=config, address="10.0.0.1")
        await asyncio.sleep(0.05)  # the first job takes the one slot
        with pytest.raises(Busy, match="already have"):
            await jobs.start(owner=OWNER, session_id=sids[0], problems=problems()[:1], problem_set="user",
                             config=config)
        second = await jobs.start(owner=OTHER, session_id=sids[1], problems=problems()[:1], problem_set="user",
                                  config=config, address="10.0.0.2")
        assert store.get_comparison(second, owner=OPERATOR)["status"] == "queued"
        assert jobs.live(second)["queue_position"] == 1
        with pytest.raises(Busy, match="busy"):
            await jobs.start(owner="q" * 40, session_id=sids[2], problems=problems()[:1], problem_set="user",
                             config=config, address="10.0.0.3")
        runs = [await wait_run(store, c) for c in (first, second)]
        return runs, store.list_comparisons(owner="q" * 40)

    runs, third = asyncio.run(go())
    assert [r["status"] for r in runs] == ["done", "done"] and third == []


def test_made_up_owners_from_one_address_get_that_address_share_of_the_slots(url, store):
    async def go():
        DELAY["s"] = 0.2
        jobs = JobManager(store, StubEngine(url))  # the app's bounds: 8 active, a quarter per address
        config = RunConfig(n=1, temperature=0.5)
        started, refused = [], []
        for i in range(20):  # twenty owners, all from one address
            owner = f"{i:02d}" + "m" * 38
            sid = store.create_session(title="t", owner=owner)
            try:
                started.append(await jobs.start(owner=owner, session_id=sid, problems=problems()[:1],
                                                problem_set="user", config=config, address="203.0.113.7"))
            except Busy as e:
                refused.append(str(e))
        sid = store.create_session(title="t", owner=OTHER)  # someone else, from elsewhere, still gets in
        other = await jobs.start(owner=OTHER, session_id=sid, problems=problems()[:1], problem_set="user",
                                 config=config, address="198.51.100.2")
        for c in started + [other]:
            await wait_run(store, c)
        return started, refused, jobs.max_per_address

    started, refused, share = asyncio.run(go())
    assert len(started) == share < 8 and len(refused) == 20 - share
    assert all("your address" in r for r in refused)


def test_cancel_stops_the_run_and_keeps_what_finished(url, store):
    async def go():
        DELAY["s"] = 0.15
        jobs = JobManager(store, StubEngine(url))
        sid = store.create_session(title="t", owner=OWNER)
        cid = await jobs.start(owner=OWNER, session_id=sid, problems=problems(), problem_set="user",
                               config=RunConfig(n=2, temperature=0.8))
        while not store.get_comparison(cid, owner=OPERATOR)["results"]:
            await asyncio.sleep(0.05)
        assert not jobs.cancel(cid, OTHER)  # only its owner can
        assert jobs.cancel(cid, OWNER)
        run = await wait_run(store, cid)
        await asyncio.sleep(1.0)  # nothing more arrives after the cancel
        return run, store.get_comparison(cid, owner=OPERATOR), jobs.active_run(OWNER)

    run, later, active = asyncio.run(go())
    assert run["status"] == "cancelled" and active is None
    assert 1 <= len(run["results"]) < 2 * 3 and len(later["results"]) == len(run["results"])


def test_bad_configurations_and_a_missing_sandbox_store_nothing(url, store, monkeypatch):
    async def go(config, ps=None):
        jobs = JobManager(store, StubEngine(url))
        sid = store.create_session(title="t", owner=OWNER)
        await jobs.start(owner=OWNER, session_id=sid, problems=problems() if ps is None else ps, problem_set="user",
                         config=config)

    for config in (RunConfig(n=3), RunConfig(temperature=0.0), RunConfig(top_p=0), RunConfig(max_tokens=0),
                   RunConfig(seed=-1), RunConfig(mode="poetry")):
        with pytest.raises(RunInputError):
            asyncio.run(go(config))
    with pytest.raises(RunInputError, match="at least one"):
        asyncio.run(go(RunConfig(), ps=[]))
    monkeypatch.setattr(checks, "sandbox_available", lambda: (False, "bubblewrap is not installed"))
    with pytest.raises(checks.SandboxMissing, match="bubblewrap"):
        asyncio.run(go(RunConfig()))
    assert store.list_comparisons(owner=OPERATOR) == []


KILLED = """
import asyncio, sys
from laneplay.app.jobs import JobManager, RunConfig
from laneplay.evals.problems import user_problem
from laneplay.storage import Store

class Engine:
    ready, state, detail, api_key, info = True, "ready", "", None, {"model": "scripted"}
    url = sys.argv[1]

async def main():
    store = Store(sys.argv[2])
    jobs = JobManager(store, Engine())
    sid = store.create_session(title="t", owner="o" * 40)
    ps = [user_problem("def add(a, b):\\n", "assert add(1, 2) == 3", task_id=f"user/{i}") for i in range(6)]
    await jobs.start(owner="o" * 40, session_id=sid, problems=ps, problem_set="user", config=RunConfig(n=2))
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_server_killed_mid_run_keeps_what_finished_and_the_run_reads_interrupted(url, tmp_path):
    DELAY["s"] = 0.2
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, url, db], start_new_session=True)
    store = Store(db)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = store.list_comparisons(owner=OPERATOR)
            if runs and runs[0]["results_stored"] >= 3:
                break
            assert proc.poll() is None
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        before = store.get_comparison(store.list_comparisons(owner=OPERATOR)[0]["id"], owner=OPERATOR)
        assert before["status"] == "running" and len(before["results"]) >= 3
        assert store.interrupt_unfinished() == 1  # what `laneplay serve` does as it starts
        after = store.get_comparison(before["id"], owner=OPERATOR)
        assert after["status"] == "interrupted" and after["results"] == before["results"]
        part = summarize(after)
        assert part["greedy_done"] >= 1 and part["problems_complete"] < 6
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        store.close()
