"""The Side by side tab's pieces: presets, checked settings, the one batched request (and the per-column
fallback), code for "Use this" and "Run tests", the aggregate arithmetic, the share page's columns, and the
streaming core against a tiny in-process server, with the `samples` extension and without it."""
import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from laneplay.api_client import EngineClient, StreamEvent
from laneplay.app.context import InputError
from laneplay.app.sidebyside import (PRESETS, aggregate, aggregate_html, batch_request, column_code, column_requests,
                                     engine_requests, entry_point_of, preset, problem_for, reference_ms, settings,
                                     share_html)
from laneplay.app.stream import Column, Generation
from laneplay.app.web import share_page
from laneplay.evals.problems import ProblemError

from .serving import serve


def test_presets_fill_a_column_and_keep_its_own_seed():
    assert preset("greedy", 0) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    assert preset("T=0.8", 2) == {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 2}
    assert len({preset("T=1.2", i)["seed"] for i in range(4)}) == 4
    assert [PRESETS[k][0] for k in PRESETS] == [0.0, 0.2, 0.8, 1.2]
    with pytest.raises(InputError):
        preset("T=9", 0)


def test_settings_are_checked_per_column_and_shared_ones_once():
    shared, cols = settings(3, [0, 0.8, 1.2, 5], [1, 0.95, 0.9, 1], [0, 50, 0, 0], [0, 1, "", 3], 48, "\\n\\n")
    assert shared == {"max_tokens": 48, "stop": ["\n\n"]}
    assert cols == [{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
                    {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 1},
                    {"temperature": 1.2, "top_p": 0.9, "top_k": 0}]  # an empty seed is left to the engine
    with pytest.raises(InputError, match="Column 2: Temperature"):
        settings(2, [0, 101], [1, 1], [0, 0], [0, 1], 48, "")  # the engine takes up to 100
    with pytest.raises(InputError, match="^Max tokens"):
        settings(2, [0, 0], [1, 1], [0, 0], [0, 1], 0, "")


def test_one_request_carries_every_column_as_a_sample():
    shared, cols = settings(3, [0, 0.8, 1.2], [1, 0.95, 0.95], [0, 50, 50], [0, 1, 2], 40, "")
    body, chat = batch_request("chat", "def add(a, b):\n", "Write add.", shared, cols)
    assert chat and "n" not in body and "temperature" not in body
    assert body["samples"] == cols and body["max_tokens"] == 40
    assert body["messages"][0]["content"].startswith("Write add.\n\n```python\ndef add(a, b):")
    body, chat = batch_request("complete", "def add(a, b):\n", "", shared, cols)
    assert not chat and body["prompt"] == "def add(a, b):\n" and len(body["samples"]) == 3
    per_column = column_requests("chat", "", "Write add.", shared, cols)
    assert [b["temperature"] for b, _ in per_column] == [0.0, 0.8, 1.2]
    assert "top_k" not in per_column[0][0] and per_column[1][0]["top_k"] == 50 and per_column[2][0]["seed"] == 2
    assert all("samples" not in b for b, _ in per_column)


ANSWER = ("Here you go:\n```python\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```\n"
          "It adds.")


def test_use_this_takes_the_code_block_or_editor_code_plus_completion():
    assert column_code("chat", "", "Write add.", ANSWER) == "def add(a, b):\n    return a + b\n"
    assert column_code("complete", "def add(a, b):\n", "", "    return a + b\n") == \
        "def add(a, b):\n    return a + b\n"
    assert column_code("chat", "", "Write add.", "   ") == ""


def test_the_entry_point_comes_from_the_user_the_prompt_the_tests_or_the_answer():
    assert entry_point_of("def add(a, b):\n", "", "") == "add"
    assert entry_point_of("Write it.", "assert plus(1, 2) == 3", "def helper():\n    pass\ndef plus(a, b):\n") == "plus"
    assert entry_point_of("Write it.", "", "```python\ndef first(x):\n```") == "first"
    assert entry_point_of("Write it.", "", "no code", given=" mine ") == "mine"
    assert entry_point_of("Write it.", "", "no code") is None


def test_tests_become_a_problem_and_bad_tests_are_refused():
    problem, code, _ = problem_for("chat", "", "Write add.", ANSWER, "assert add(1, 2) == 3", "")
    assert problem.entry_point == "add" and code.startswith("def add(a, b):") and "print" not in code
    problem, code, _ = problem_for("complete", "def add(a, b):\n", "", "    return a + b\n\ndef x():\n",
                                    "assert add(1, 2) == 3", None)
    assert code == "def add(a, b):\n    return a + b\n"  # cut at the next top-level def
    for bad in ("x = 1", "assert (", ""):
        with pytest.raises(ProblemError):
            problem_for("chat", "", "Write add.", ANSWER, bad, "")
    with pytest.raises(ProblemError, match="Entry point"):
        problem_for("chat", "", "Write add.", "no code at all", "assert f(1) == 1", "")


def test_aggregate_arithmetic():
    agg = aggregate([10, 20, 31], 2.0, 20.0)
    assert agg["decoded"] == 58 and agg["tokens"] == 61  # each column's first token came from the prefill
    assert agg["batch_tps"] == pytest.approx(29.0) and agg["column_tps"] == pytest.approx(29.0 / 3)
    assert agg["single_tps"] == pytest.approx(50.0) and agg["sequential_s"] == pytest.approx(1.16)
    assert agg["speedup"] == pytest.approx(0.58)
    none = aggregate([5, 5], None, None)
    assert none["batch_tps"] is None and none["speedup"] is None and none["sequential_s"] is None
    html = aggregate_html(aggregate([10, 20, 31], 2.0, None), None, "done")
    assert 'data-batch-tps="29.00"' in html and 'data-columns="3"' in html and 'data-single-ms-per-token=""' in html
    assert "run one Playground generation in this page for a batch-1 reference" in html
    html = aggregate_html(agg, 20.0, "done")
    assert 'data-speedup="0.58"' in html and "20.0 ms/token" in html


def test_the_batch_1_reference_is_this_pages_own_last_playground_run():
    assert reference_ms(None) is None and reference_ms({}) is None  # nothing measured in this page yet
    run = {"batch_1": True, "state": "done", "tokens": 40, "ms_per_token": 12.5}
    assert reference_ms(run) == 12.5
    assert reference_ms({**run, "state": "stopped", "ms_per_token": 11.0}) == 11.0  # up to the stop
    assert reference_ms({**run, "state": "error"}) is None
    assert reference_ms({**run, "tokens": 1, "ms_per_token": None}) is None  # one token: no step time
    assert reference_ms({**run, "batch_1": False}) is None  # a stored record History put back: maybe a batch
    html = aggregate_html(aggregate([10, 10], 1.0, 12.5), 12.5, "done")
    assert "this page's last Playground generation" in html and 'data-single-ms-per-token="12.50"' in html


def gen(batch, i, kind="side-by-side", **kw):
    return {"batch": batch, "sample_index": i, "kind": kind, "seed": i, "temperature": [0.0, 0.8, 1.2][i],
            "top_p": 0.95, "top_k": 50, "text": f"text {batch}/{i}", "finish_reason": "length",
            "completion_tokens": 40, "prompt_tokens": 30, "ttft_ms": 80.0, "decode_tokens_per_second": 30.0,
            "ms_per_token": 33.3, "device": "cpu", "world_size": 1, "test_status": None, "test_error": None, **kw}


def test_the_share_page_shows_a_batch_as_columns_and_keeps_the_playground_ids():
    gens = [gen(1, 0, kind=None), gen(2, 0, test_status="pass"), gen(2, 1, test_status="fail",
                                                                      test_error="AssertionError"), gen(2, 2)]
    cols = share_html(gens[1:])
    assert cols.count("lp-sbs-share-col") == 3 and "--cols:3" in cols
    assert 'id="sbs-b2-meter-0"' in cols and 'data-state="done"' in cols and "greedy · top-p 0.95" in cols
    assert "data-status='pass'" in cols and "AssertionError" in cols and "not tested" in cols
    page = share_page("t" * 43, {"generations": gens, "code": "", "instruction": "", "comparisons": []})
    assert page.count('id="meter"') == 1 and "id=output>text 1/0" in page
    assert page.count("lp-sbs-share-col") == 3 and "Output 1 " in page


# ---- the streaming core against an in-process server ------------------------------------------------------

def fake_engine() -> FastAPI:
    """Streams choices interleaved by index; with `samples` it answers as one batch with our timing, without
    it as a plain OpenAI server (one choice, no timing). Requests are logged."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if body.get("max_tokens") == 99:
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429, headers={"Retry-After": "7"})
        samples = body.get("samples") or [{"temperature": body.get("temperature")}]

        async def events():
            if "samples" in body:
                yield ": laneplay running\n\n"
            if body.get("max_tokens") == 7:  # sample 0 ends at once with its timing; sample 1 runs until stopped
                first = {"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}
                timing = {"index": 0, "ttft_ms": 4.0, "decode_tokens_per_second": None, "ms_per_token": None,
                          "completion_tokens": 1}
                yield f"data: {json.dumps({'choices': [first], 'laneplay': {'per_choice': [timing]}})}\n\n"
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    yield f"data: {json.dumps({'choices': [{'index': 1, 'delta': {'content': 'b'}}]})}\n\n"
                return
            for k in range(3):
                for i, s in enumerate(samples):
                    await asyncio.sleep(0.01)
                    choice = {"index": i, "delta": {"content": f"T{s['temperature']}.{k} "},
                              "finish_reason": "length" if k == 2 else None}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            final = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3 * len(samples)}}
            if "samples" in body:
                final["laneplay"] = {"ttft_ms": 5.0, "total_ms": 105.0, "decode_tokens_per_second": 40.0,
                                     "device": "cpu", "world_size": 1,
                                     "per_choice": [{"index": i, "ttft_ms": 5.0 + i, "decode_tokens_per_second": 20.0,
                                                     "ms_per_token": 50.0, "completion_tokens": 3}
                                                    for i in range(len(samples))]}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def engine():
    app = fake_engine()
    with serve(app) as url:
        yield SimpleNamespace(client=lambda: EngineClient(url), engine=SimpleNamespace(ready=True), app=app)


def run_batch(ctx, requests, n, wanted=lambda: True):
    b = Generation([Column({"temperature": t}) for t in [0.0, 0.8, 1.2][:n]])

    async def go():
        async for _ in b.run(ctx, requests, wanted):
            pass
    asyncio.run(go())
    return b


def test_one_batched_request_streams_every_column_by_index(engine):
    shared, cols = settings(3, [0, 0.8, 1.2], [1, 1, 1], [0, 0, 0], [0, 1, 2], 3, "")
    engine.app.state.bodies.clear()
    b = run_batch(engine, engine_requests(True, "chat", "", "Write add.", shared, cols), 3)
    assert len(engine.app.state.bodies) == 1 and len(engine.app.state.bodies[0]["samples"]) == 3
    assert b.finish() is None
    assert [c.text for c in b.columns] == ["T0.0.0 T0.0.1 T0.0.2 ", "T0.8.0 T0.8.1 T0.8.2 ", "T1.2.0 T1.2.1 T1.2.2 "]
    assert [c.meter.engine_ttft_ms for c in b.columns] == [5.0, 6.0, 7.0]  # each column got its own server timing
    assert all(c.meter.ttft_ms >= 0 for c in b.columns)  # and the TTFT from the click beside it
    assert all(c.meter.source == "server" and c.meter.state == "done" and c.finish == "length" for c in b.columns)
    assert b.timing["decode_tokens_per_second"] == 40.0 and b.columns[0].prompt_tokens == 12


def test_servers_without_samples_get_one_request_per_column(engine):
    shared, cols = settings(2, [0, 0.8], [1, 1], [0, 0], [0, 1], 3, "")
    engine.app.state.bodies.clear()
    b = run_batch(engine, engine_requests(False, "chat", "", "Write add.", shared, cols), 2)
    assert len(engine.app.state.bodies) == 2 and all("samples" not in x for x in engine.app.state.bodies)
    b.finish()
    assert [c.text for c in b.columns] == ["T0.0.0 T0.0.1 T0.0.2 ", "T0.8.0 T0.8.1 T0.8.2 "]
    assert all(c.meter.source == "app" and c.meter.tokens == 3 and c.meter.tps for c in b.columns)


def test_stop_ends_the_streams_and_keeps_what_came(engine):
    shared, cols = settings(2, [0, 0.8], [1, 1], [0, 0], [0, 1], 3, "")
    t0 = time.monotonic()
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols), 2,
                  wanted=lambda: time.monotonic() - t0 < 0.03)
    b.finish()
    assert b.cancelled and all(c.meter.state in ("done", "stopped") for c in b.columns)
    stopped = [c for c in b.columns if c.finish == "cancelled"]
    assert stopped and all(c.meter.state == "stopped" and c.meter.source == "app" for c in stopped)


def test_stop_keeps_the_engines_timing_of_a_finished_column_and_says_stopped_for_the_rest(engine):
    shared, cols = settings(2, [0, 0.8], [1, 1], [0, 0], [0, 1], 7, "")
    t0 = time.monotonic()
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols), 2,
                  wanted=lambda: time.monotonic() - t0 < 0.5)
    assert b.finish() is None and b.cancelled
    done, cut = b.columns
    assert (done.meter.state, done.meter.source, done.meter.engine_ttft_ms, done.finish) == ("done", "server", 4.0, "stop")
    assert done.meter.ttft_ms is not None  # from the click, as the page timed it
    assert cut.meter.state == "stopped" and cut.meter.source == "app" and cut.finish == "cancelled"
    assert cut.meter.tokens >= 3 and cut.meter.tps and cut.text.startswith("bbb")  # the app's timing up to Stop


def test_an_engine_error_is_one_message_and_every_meter_says_error(engine):
    shared, cols = settings(2, [0, 0.8], [1, 1], [0, 0], [0, 1], 99, "")
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols), 2)
    assert b.finish() == "The engine is busy: queue full. Retry in about 7 s."
    assert [c.meter.state for c in b.columns] == ["error", "error"]
    b = run_batch(engine, engine_requests(False, "chat", "", "x", shared, cols), 2)
    assert b.finish().startswith("Column ") and "busy" in b.failure


def test_routing_ignores_choices_past_the_shown_columns():
    b = Generation([Column({}), Column({})])
    b.route(None, StreamEvent("running"))
    assert [c.meter.state for c in b.columns] == ["running", "running"]
    b.route(None, StreamEvent("delta", index=1, text="x"))
    b.route(None, StreamEvent("delta", index=5, text="y"))
    assert [c.text for c in b.columns] == ["", "x"] and b.columns[1].meter.tokens == 1
