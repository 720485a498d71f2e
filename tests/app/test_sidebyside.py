"""The Side by side tab's pieces: presets, checked settings, the one batched request (and the per-column
fallback), one request per column when a column speculates, code for "Use this" and "Run tests", the
aggregate arithmetic, the share page's columns, and the streaming core against a tiny in-process server,
with the `samples` extension, without it, and per column with speculation."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from laneplay.api_client import EngineClient, StreamEvent
from laneplay.app.context import InputError
from laneplay.app.sidebyside import (PRESETS, SideBySide, aggregate, aggregate_html, batch_request, column_code,
                                     column_requests, engine_requests, entry_point_of, preset, problem_for,
                                     reference_ms, settings, share_html)
from laneplay.app.stream import Column, Generation
from laneplay.app.web import share_page
from laneplay.evals.problems import ProblemError
from laneplay.storage import OPERATOR, Store

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


def test_a_speculating_column_makes_one_request_per_column_each_with_its_own_speculation():
    shared, cols = settings(3, [0, 0, 0.8], [1, 1, 0.95], [0, 0, 50], [0, 1, 2], 40, "")
    for off in (None, [False, False, False], [False] * 4):  # nothing on: exactly the one batch request of before
        (col, body, chat), = engine_requests(True, "chat", "", "Write add.", shared, cols, off)
        assert col is None and body["samples"] == cols and "laneplay" not in body and chat
        assert (col, body, chat) == engine_requests(True, "chat", "", "Write add.", shared, cols)[0]
    sent = engine_requests(True, "chat", "def add(a, b):\n", "Write add.", shared, cols, [True, False, True])
    assert [col for col, _, _ in sent] == [0, 1, 2]
    # greedy and on: "lookup" (it drafts beside the other columns); sampled and on: "auto" (runs plain)
    assert [b["laneplay"] for _, b, _ in sent] == [{"speculative": "lookup"}, {"speculative": "off"},
                                                    {"speculative": "auto"}]
    plain = column_requests("chat", "def add(a, b):\n", "Write add.", shared, cols)
    for (_, body, chat), (want, want_chat) in zip(sent, plain):  # each column's own sampling settings and seed
        assert {k: x for k, x in body.items() if k != "laneplay"} == want and chat == want_chat
        assert "samples" not in body and "n" not in body and body["max_tokens"] == 40
    assert [b["seed"] for _, b, _ in sent] == [0, 1, 2] and [b["temperature"] for _, b, _ in sent] == [0.0, 0.0, 0.8]
    assert "top_k" not in sent[0][1] and sent[2][1]["top_k"] == 50
    assert len(engine_requests(True, "chat", "", "x", shared, cols, [False, True])) == 3  # a short list: the rest off
    # A server without our extensions: plain requests per column, with or without the checkboxes.
    for spec in (None, [True, True, True]):
        assert all(col == i and "laneplay" not in b for i, (col, b, _) in
                   enumerate(engine_requests(False, "chat", "", "x", shared, cols, spec)))


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


def test_the_aggregate_line_says_what_a_per_column_run_measures():
    batch = aggregate_html(aggregate([10, 20], 1.0, None), None, "done")
    assert 'data-requests="batch"' in batch and 'data-speculative=""' in batch and "Batch of 2: 28.0 tokens/s" in batch
    agg = aggregate([10, 20], 1.0, 20.0, requests="per-column", speculative=[0])
    assert agg["batch_tps"] == pytest.approx(28.0) and agg["requests"] == "per-column"
    html = aggregate_html(agg, 20.0, "done")
    assert 'data-requests="per-column"' in html and 'data-speculative="0"' in html and 'data-batch-tps="28.00"' in html
    assert "2 requests, one per column (speculation on in column 1): 28.0 tokens/s" in html
    assert "timed here from the first token of any column to the last of any" in html and "Batch of" not in html
    assert "this run's time" in html
    running = aggregate_html(aggregate([1, 0, 0], None, None, "per-column", [0, 2]), None, "running")
    assert "3 requests, one per column (speculation on in columns 1 and 3)</b> · measuring" in running
    idle = aggregate_html(None, None)
    assert 'data-requests="batch"' in idle and "one request per column when a column speculates" in idle


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
    assert "data-speculative" not in cols and "speculation" not in cols and "in one batch" in cols  # older runs


def test_the_share_page_shows_each_columns_speculation():
    cols = share_html([gen(3, 0, temperature=0.0, speculative=True), gen(3, 1, temperature=0.0, speculative=False)])
    assert "data-column='0' data-speculative='1'" in cols and "data-column='1' data-speculative='0'" in cols
    assert "seed 0 · speculation on" in cols and "seed 1 · speculation off" in cols
    assert "2 columns one request per column" in cols and "in one batch" not in cols
    cols = share_html([gen(4, 0, speculative=False), gen(4, 1, speculative=False)])
    assert "in one batch" in cols and cols.count("speculation off") == 2


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
        if "laneplay" in body:
            return StreamingResponse(ours_alone(body), media_type="text/event-stream")
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


SPEC_COUNTS = {"draft_tokens": 2, "accepted_tokens": 1, "decode_steps": 1}  # 3 tokens: the first, then 2 in 1 step


async def ours_alone(body):
    """Our server's answer to a request of one sample with a "laneplay" object: "auto" or "lookup" on a greedy request
    speculates (live counts, then the final ones in its timing); anything else decodes one token a step."""
    spec = body["laneplay"]["speculative"] in ("auto", "lookup") and body.get("temperature") == 0.0
    yield ": laneplay running\n\n"
    for k in range(3):
        await asyncio.sleep(0.01)
        if spec and k == 2:
            yield ": laneplay speculative 0 2 1 1 3\n\n"
        choice = {"index": 0, "delta": {"content": f"S{body['seed']}.{k} "}, "finish_reason": "length" if k == 2 else None}
        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
    counts = ({"speculative": "lookup", **SPEC_COUNTS} if spec else
              {"speculative": "off", "draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 2})
    timing = {"index": 0, "ttft_ms": 5.0, "decode_tokens_per_second": 30.0, "ms_per_token": 33.0,
              "completion_tokens": 3, **counts}
    final = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3},
             "laneplay": {"ttft_ms": 5.0, "total_ms": 80.0, "device": "cpu", "world_size": 1, "per_choice": [timing]}}
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def engine():
    app = fake_engine()
    with serve(app) as url:
        yield SimpleNamespace(client=lambda: EngineClient(url), engine=SimpleNamespace(ready=True), app=app)


def run_batch(ctx, requests, n, stop_when=lambda b: False):
    """The columns' run to its end, or until stop_when(the run) (then as the Stop button stops it)."""
    b = Generation([Column({"temperature": t}) for t in [0.0, 0.8, 1.2][:n]])

    async def go():
        async for _ in b.run(ctx, requests, lambda: not stop_when(b)):
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
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols), 2,  # Stop at the first token
                  stop_when=lambda b: any(c.meter.tokens for c in b.columns))
    b.finish()
    assert b.cancelled and all(c.meter.state in ("done", "stopped") for c in b.columns)
    stopped = [c for c in b.columns if c.finish == "cancelled"]
    assert stopped and all(c.meter.state == "stopped" and c.meter.source == "app" for c in stopped)


def test_stop_keeps_the_engines_timing_of_a_finished_column_and_says_stopped_for_the_rest(engine):
    shared, cols = settings(2, [0, 0.8], [1, 1], [0, 0], [0, 1], 7, "")
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols), 2,  # Stop once both have shown
                  stop_when=lambda b: b.columns[0].meter.state == "done" and b.columns[1].meter.tokens >= 3)
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


def test_the_meter_says_while_sharing_the_engine_holds_speculation_back_and_for_how_many_steps():
    from laneplay.app.meter import render

    b = Generation([Column({})])
    b.route(None, StreamEvent("running", args=["12.5"]))  # the engine's wait, as our server says it
    b.route(None, StreamEvent("speculative", args=["0", "4", "4", "2", "7", "0", "0"]))  # drafting, alone
    m = b.columns[0].meter
    assert m.queue_ms == 12.5 and "waited 12 ms" in render(m)
    assert (m.accepted_per_step, m.acceptance, m.paused_steps, m.speculation_paused) == (3.0, 1.0, 0, False)
    assert 'data-drafting-paused=""' in render(m) and "paused" not in render(m).split("lp-cells")[1]
    b.route(None, StreamEvent("sharing", position=2))
    b.route(None, StreamEvent("speculative", args=["0", "4", "4", "5", "10", "3", "1"]))  # 3 steps held back
    html = render(m)
    assert 'data-drafting-paused="1"' in html and 'data-paused-steps="3"' in html
    assert "drafting paused while sharing" in html and "sharing the engine with 2 other" in html
    b.route(None, StreamEvent("speculative", args=["0", "6", "6", "6", "13", "3", "0"]))  # drafting again
    html = render(m)
    assert 'data-drafting-paused=""' in html and "paused 3 steps while sharing" in html
    b.route(None, StreamEvent("speculative", args=["0", "6", "6", "7", "14"]))  # an older server's five numbers
    assert (m.accepted_per_step, m.paused_steps) == (13 / 7, 3)
    for args in (["x", "1", "1", "1", "2"], ["0", "1", "-1", "1", "2"], ["0", "1", "1", "1e9", "2", "0", "0"],
                 ["0", "9" * 40, "1", "1", "2"], ["7", "1", "1", "1", "2"]):  # not ours to read, or no such column
        b.route(None, StreamEvent("speculative", args=args))
    assert (m.accepted_per_step, m.paused_steps) == (13 / 7, 3)
    from laneplay.app.stream import _float

    assert [_float(x) for x in ("12.5", "0", "nan", "inf", "-1", "x")] == [12.5, 0.0, None, None, None, None]


def test_per_column_requests_stream_each_column_with_its_own_speculation_counts(engine):
    shared, cols = settings(2, [0, 0], [1, 1], [0, 0], [0, 1], 3, "")
    engine.app.state.bodies.clear()
    b = run_batch(engine, engine_requests(True, "chat", "", "Write add.", shared, cols, [True, False]), 2)
    assert [x["laneplay"] for x in engine.app.state.bodies] in ([{"speculative": "lookup"}, {"speculative": "off"}],
                                                                 [{"speculative": "off"}, {"speculative": "lookup"}])
    assert b.finish() is None and b.timing is None  # two requests: no one record of the run
    assert [c.text for c in b.columns] == ["S0.0 S0.1 S0.2 ", "S1.0 S1.1 S1.2 "]
    on, off = (c.meter for c in b.columns)
    assert (on.accepted_per_step, on.acceptance) == (2.0, 0.5)  # the engine's: (3 - 1) / 1 step, 1 of 2 drafts
    assert (off.accepted_per_step, off.acceptance) == (None, None)  # a column that did not speculate shows none
    assert all(m.source == "server" and m.state == "done" and m.engine_ttft_ms == 5.0 for m in (on, off))
    assert b.decode_s() is not None  # timed here: first token of any column to the last of any


OWNER = "o" * 43


def sbs_context(engine, info: dict):
    return SimpleNamespace(client=engine.client, engine=SimpleNamespace(ready=True, info=info, state="ready",
                                                                        detail=""), store=Store("sqlite://"))


def generate(ctx, spec: list[bool], n: int = 2) -> tuple[list, dict]:
    """SideBySide's run of n greedy columns (seeds 0, 1, ...) as the page gets it: its frames, and the run."""
    shared, cols = settings(n, [0] * n, [1] * n, [0] * n, list(range(n)), 3, "")
    runs = {"mode": "chat", "code": "", "instruction": "Write add.", "n": n, "sid": None, "batch": None}
    tab, frames = SideBySide(ctx), []

    async def go():
        async for f in tab._generate(tab.pages.begin(("me", "page")), runs, OWNER, shared, cols, None, spec):
            frames.append(f)
    asyncio.run(go())
    return frames, runs


def test_a_run_with_a_speculating_column_is_stored_and_shown_per_column(engine):
    ctx = sbs_context(engine, {"laneplay": True, "device": "cpu", "model": "m"})
    engine.app.state.bodies.clear()
    frames, runs = generate(ctx, [True, False])
    assert len(engine.app.state.bodies) == 2 and not any("samples" in x for x in engine.app.state.bodies)
    assert all(x["logprobs"] for x in engine.app.state.bodies)  # the token views, as in the batch
    last = frames[-1]
    assert [c.text for c in last.g.columns] == ["S0.0 S0.1 S0.2 ", "S1.0 S1.1 S1.2 "]
    assert 'data-state="done"' in last.agg and 'data-requests="per-column"' in last.agg
    assert 'data-speculative="0"' in last.agg and "2 requests, one per column" in last.agg
    row = last.row()
    meters = row[4:6]
    assert 'data-accepted-per-step="2.000"' in meters[0] and 'data-acceptance="0.500"' in meters[0]
    assert 'data-accepted-per-step=""' in meters[1] and 'data-acceptance=""' in meters[1]
    gens = ctx.store.get_session(runs["sid"], owner=OPERATOR)["generations"]
    assert [(g["speculative"], g["seed"], g["temperature"], g["kind"]) for g in gens] == \
        [(True, 0, 0.0, "side-by-side"), (False, 1, 0.0, "side-by-side")]
    token, _ = ctx.store.share_session(runs["sid"], owner=OPERATOR)
    page = share_page(token, ctx.store.get_shared(token))
    assert "speculation on" in page and "speculation off" in page and "one request per column" in page


def test_a_run_without_speculation_is_one_batch_request_as_before(engine):
    ctx = sbs_context(engine, {"laneplay": True})
    engine.app.state.bodies.clear()
    frames, runs = generate(ctx, [False, False, False], n=3)
    (body,) = engine.app.state.bodies
    assert len(body["samples"]) == 3 and "laneplay" not in body
    assert 'data-requests="batch"' in frames[-1].agg and "Batch of 3" in frames[-1].agg
    gens = ctx.store.get_session(runs["sid"], owner=OPERATOR)["generations"]
    assert [g["speculative"] for g in gens] == [False, False, False]


def test_a_plain_server_gets_plain_requests_and_nothing_is_stored_about_speculation(engine):
    ctx = sbs_context(engine, {"laneplay": False})
    engine.app.state.bodies.clear()
    frames, runs = generate(ctx, [True, False])
    assert len(engine.app.state.bodies) == 2 and not any("laneplay" in x for x in engine.app.state.bodies)
    assert 'data-requests="per-column"' in frames[-1].agg and 'data-speculative=""' in frames[-1].agg
    gens = ctx.store.get_session(runs["sid"], owner=OPERATOR)["generations"]
    assert [g["speculative"] for g in gens] == [None, None]


def test_stop_ends_every_per_column_request(engine):
    shared, cols = settings(2, [0, 0], [1, 1], [0, 0], [0, 1], 3, "")
    b = run_batch(engine, engine_requests(True, "chat", "", "x", shared, cols, [True, False]), 2,
                  stop_when=lambda b: any(c.meter.tokens for c in b.columns))  # Stop at the first token
    assert b.finish() is None and b.cancelled
    assert all(c.meter.state in ("done", "stopped") for c in b.columns)
    assert any(c.meter.state == "stopped" and c.finish == "cancelled" for c in b.columns)
