"""The engine HTTP server end to end: real uvicorn servers on free ports around the embedded default model.

Generated text is compared with `engine.generate` for the same seed; requests stay short (<= 16 tokens).
"""
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from laneplay.engine import SamplingParams
from laneplay.engine.server import EngineServer, create_app

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You are a concise coding assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Write a Python function that adds two numbers."}]}]
CHAT_FLAT = [CHAT[0], {"role": "user", "content": "Write a Python function that adds two numbers."}]
PROMPT = "def fibonacci(n):"


def start_server(app):
    """Run `app` with the engine's uvicorn server in a background thread on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = EngineServer(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@contextmanager
def serve(app):
    url, server, thread = start_server(app)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def reference(eng, prompt, chat=False, **params):
    """What the engine itself gives: (texts by sample index, final metrics by sample index)."""
    texts, finals = {}, {}
    for ev in eng.generate(prompt, SamplingParams(**params), chat=chat):
        texts[ev.sample_index] = texts.get(ev.sample_index, "") + ev.text
        if ev.finish_reason:
            finals[ev.sample_index] = ev.metrics
    return texts, finals


def scrape(url, **headers) -> dict:
    """/metrics parsed by the Prometheus text parser: {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", headers=headers).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def speculation_counts(before: dict, after: dict, mode: str) -> dict:
    """What /metrics (two `scrape`s) counted of the requests that asked for this speculation mode between them."""
    key = lambda name: (f"laneplay_{name}_total", (("speculative", mode),))  # noqa: E731
    return {name: after.get(key(name), 0) - before.get(key(name), 0)
            for name in ("draft_tokens", "accepted_tokens", "decode_steps", "step_tokens")}


def sse_data(lines):
    """The JSON payloads of an SSE stream, up to [DONE]."""
    for line in lines:
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line[len("data: "):])


@pytest.fixture(scope="module")
def server(default_engine):
    with serve(create_app(default_engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(default_engine):
    texts, finals = reference(default_engine, PROMPT, max_tokens=16, temperature=0.0)
    return texts[0], finals[0]


# ---- OpenAI compatibility ------------------------------------------------------------------------
def test_openai_chat_stream_matches_engine_for_seed(client, default_engine):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0.8, seed=7, stream=True,
        stream_options={"include_usage": True}))
    ref, finals = reference(default_engine, CHAT_FLAT, chat=True, max_tokens=12, temperature=0.8, seed=7)
    assert chunks[0].id.startswith("chatcmpl-") and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [finals[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == len(default_engine.tokenizer.encode_chat(CHAT_FLAT))
    assert usage.completion_tokens == finals[0].completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    timing = chunks[-1].model_extra["laneplay"]
    assert timing["ttft_ms"] > 0 and timing["device"] == "cpu" and timing["world_size"] == 1
    assert timing["per_choice"][0]["seed"] == 7 and timing["queue_ms"] >= 0


def test_openai_completion_stream_greedy_matches_engine(client, greedy):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].id.startswith("cmpl-") and chunks[0].object == "text_completion"
    assert "".join(c.choices[0].text for c in chunks) == greedy[0]
    assert chunks[-1].choices[0].finish_reason == greedy[1].finish_reason
    # Without include_usage, the chunk that finishes the last choice carries the whole timing.
    timing = chunks[-1].model_extra["laneplay"]
    assert timing["per_choice"][0]["completion_tokens"] == greedy[1].completion_tokens
    assert timing["decode_tokens_per_second"] > 0


def test_n3_gives_three_distinct_seeded_choices(client, default_engine):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=5, n=3)
    ref, finals = reference(default_engine, CHAT_FLAT, chat=True, max_tokens=8, temperature=1.0, seed=5, n=3)
    texts = [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]
    assert texts == [ref[i] for i in range(3)] and len(set(texts)) == 3
    assert resp.usage.completion_tokens == sum(m.completion_tokens for m in finals.values())
    assert [p["seed"] for p in resp.model_extra["laneplay"]["per_choice"]] == [5, 6, 7]


def test_stop_strings_end_the_text(client, default_engine, greedy):
    text = greedy[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    resp = client.completions.create(model=default_engine.model_name,  # the checkpoint's own name works too
                                     prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@never@@"])
    assert resp.choices[0].text == text[:text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


# ---- scheduling ----------------------------------------------------------------------------------
class GatedEngine:
    """The default engine, except that a request's prefill waits for the gate: the queue fills
    deterministically."""

    def __init__(self, eng):
        self._eng, self.gate = eng, threading.Event()
        self.runner = GatedRunner(eng.runner, self.gate)

    def __getattr__(self, name):
        return getattr(self._eng, name)


class GatedRunner:
    def __init__(self, runner, gate):
        self._runner, self.gate = runner, gate

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def prefill_steps(self, *args, **kwargs):
        steps, reused = self._runner.prefill_steps(*args, **kwargs)

        def gated():
            assert self.gate.wait(120), "the test never opened the gate"
            yield from steps
        return gated(), reused


FIFO_PROMPT = "# A list of fruits:\n"


async def _fill_queue_then_serve(url, gated):
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def stream(seed):
            body = {"prompt": FIFO_PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": seed, "stream": True,
                    "stream_options": {"include_usage": True}}
            text, timing = "", None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for chunk in _aiter_sse(r):
                    assert "error" not in chunk
                    text += "".join(c["text"] for c in chunk["choices"])
                    timing = chunk.get("laneplay", timing)
            return text, timing

        async def until(pred):
            for _ in range(3000):
                if pred((await http.get("/health")).json()):
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the server never reached the expected state")

        blocker = asyncio.create_task(stream(999))
        await until(lambda h: h["busy"])  # the worker holds the blocker at the gate
        # A queued client that goes away is dropped from the queue before it starts.
        leaver = asyncio.create_task(stream(998))
        await until(lambda h: h["queue_depth"] == 1)
        leaver.cancel()
        await until(lambda h: h["queue_depth"] == 0)
        clients = []
        for i in range(20):  # one by one, so arrival order is client order
            clients.append(asyncio.create_task(stream(1000 + i)))
            await until(lambda h: h["queue_depth"] == i + 1)
        full = await http.post("/v1/completions", json={"prompt": FIFO_PROMPT, "max_tokens": 4})
        gated.gate.set()
        results = await asyncio.gather(blocker, *clients)
        return full, results[1:], scrape(url)


async def _aiter_sse(response):
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def test_twenty_clients_served_in_arrival_order_and_the_next_gets_429(default_engine):
    gated = GatedEngine(default_engine)  # one row per step: the engine takes one request at a time
    with serve(create_app(gated, max_queue=20, model_name=MODEL, max_rows=1)) as url:
        full, results, metrics = asyncio.run(_fill_queue_then_serve(url, gated))
    assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"
    # Started in arrival order (the blocker was request 1 and the leaver request 2).
    assert [t["request_seq"] for _, t in results] == list(range(3, 23))
    assert [t["start_seq"] for _, t in results] == list(range(2, 22))
    assert metrics[("laneplay_generations_total", (("outcome", "dropped"),))] == 1
    # Each client's text is its own seed's (sample i of a seed-s batch is seed s + i, as alone).
    ref = {**reference(default_engine, FIFO_PROMPT, max_tokens=4, temperature=1.0, seed=1000, n=16)[0],
           **{16 + i: t for i, t in reference(default_engine, FIFO_PROMPT, max_tokens=4, temperature=1.0,
                                                seed=1016, n=4)[0].items()}}
    assert [text for text, _ in results] == [ref[i] for i in range(20)]


def test_disconnect_mid_stream_stops_generation(server):
    before = scrape(server)
    with httpx.Client(base_url=server, timeout=120) as http:
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            for n, _ in enumerate(sse_data(r.iter_lines()), 1):
                if n == 2:
                    break  # leaving the block closes the connection mid-stream
        nxt = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert nxt.status_code == 200
    after = scrape(server)
    cancelled = ("laneplay_generations_total", (("outcome", "cancelled"),))
    assert after[cancelled] - before.get(cancelled, 0) == 1
    # The cancelled request stopped within a few tokens of the disconnect, not at max_tokens.
    tokens = ("laneplay_generated_tokens_total", ())
    assert after[tokens] - before[tokens] - nxt.json()["usage"]["completion_tokens"] < 20


def test_time_limit_ends_with_length_and_partial_text(default_engine):
    with serve(create_app(default_engine, request_timeout_s=0.0)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                       timeout=120)
        metrics = scrape(url)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 1  # the first token, then the limit
    assert metrics[("laneplay_generations_total", (("outcome", "timeout"),))] == 1


def test_shutdown_ends_open_streams_cleanly(default_engine):
    url, server, thread = start_server(create_app(default_engine))
    try:
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(sse_data(lines))
            server.should_exit = True
            rest = [line for line in lines if line]
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


class FailingEngine(GatedEngine):
    def __init__(self, eng):
        super().__init__(eng)
        self.runner = FailingRunner(eng.runner, self.gate)


class FailingRunner(GatedRunner):
    def prefill_steps(self, *args, **kwargs):
        def fail():
            raise RuntimeError("the device fell over")
            yield
        return fail(), 0


def test_engine_failure_is_an_error_not_a_hang(default_engine):
    with serve(create_app(FailingEngine(default_engine))) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]
            with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line and not line.startswith(":")]
            assert "error" in json.loads(lines[0][6:]) and lines[-1] == "data: [DONE]"
            assert http.get("/health").json()["busy"] is False
            assert scrape(url)[("laneplay_generations_total", (("outcome", "error"),))] == 2


# ---- validation, errors, auth --------------------------------------------------------------------
BAD = [  # (path, raw body, status, param)
    ("/v1/completions", "{bad json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", '{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", '{"prompt": "x", "n": true}', 400, "n"),
    ("/v1/completions", '{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", '{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "n": 17}', 400, "n"),
    ("/v1/completions", '{"prompt": "x", "seed": -1}', 400, "seed"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": list("abcdefghi")}), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": [1] * 8192, "max_tokens": 1}), 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 100000}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "bot", "content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}',
     400, "max_completion_tokens"),
    ("/v1/completions", '{"prompt": "x", "laneplay": {"priority": "later"}}', 400, "laneplay.priority"),
    ("/v1/completions", '{"prompt": "x", "laneplay": {"priority": 1}}', 400, "laneplay.priority"),
    ("/v1/completions", '{"prompt": "x", "laneplay": {"priorty": "batch"}}', 400, "laneplay.priorty"),
    ("/v1/completions", '{"prompt": "x", "unknown_field": {"a": 1}}', 400, "unknown_field"),  # refused, not ignored
]


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        for path, raw, status, param in BAD:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (raw, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, (raw, err)
        assert http.post("/v1/completions", json={"prompt": "x", "model": "nope"}).json()["error"]["code"] == \
            "model_not_found"
        assert http.get("/v1/models/nope").status_code == 404
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "user": "u-1"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_models_health_and_metrics(server):
    models = httpx.get(server + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert httpx.get(f"{server}/v1/models/{MODEL}").json()["id"] == MODEL
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0 and health["busy"] is False

    before = scrape(server)
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=60)
    after = scrape(server)
    ok = ("laneplay_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1
    tokens = ("laneplay_generated_tokens_total", ())
    assert after[tokens] == before[tokens] + r.json()["usage"]["completion_tokens"]
    for name in ("laneplay_time_to_first_token_seconds_count", "laneplay_queue_wait_seconds_count"):
        assert after[(name, ())] == before[(name, ())] + 1
    assert ("laneplay_queue_depth", ()) in after and ("laneplay_time_per_output_token_seconds_count", ()) in after
    # one decode step (max_tokens 2: the prefill's token, then one step) of one row
    steps = ("laneplay_time_between_tokens_seconds_count", ())
    assert after[steps] == before.get(steps, 0) + 1
    rows = ("laneplay_rows_per_step_sum", ())
    assert after[rows] == before.get(rows, 0) + 1
    assert after[("laneplay_running_requests", ())] == 0


def test_api_key(default_engine):
    with serve(create_app(default_engine, api_key="s3cret", model_name=MODEL)) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="s3cret").models.list()] == [MODEL]
        assert scrape(url, Authorization="Bearer s3cret")[
            ("laneplay_requests_total", (("endpoint", "/v1/models"), ("status", "401")))] == 4


# ---- hardening -----------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_a_tiny_positive_temperature_is_served_not_a_500(server, temperature):
    errors = ("laneplay_generations_total", (("outcome", "error"),))
    before = scrape(server).get(errors, 0)
    with httpx.Client(base_url=server, timeout=120) as http:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": temperature, "seed": 1}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            events = list(sse_data(s.iter_lines()))
    assert not any("error" in e for e in events), events
    assert scrape(server).get(errors, 0) == before


def test_a_request_past_the_kv_budget_is_a_clear_400_and_nothing_is_allocated(default_engine):
    from dataclasses import replace

    from laneplay.engine import Engine

    budget = 4 * 2**30  # what a 20 GiB machine gets by default: the probe's n=16 x 8150 needs more
    eng = Engine(default_engine.cfg, default_engine.runner, replace(default_engine.runtime, kv_budget_bytes=budget),
                 default_engine.path, tokenizer=default_engine.tokenizer)
    with serve(create_app(eng, model_name=MODEL)) as url, httpx.Client(base_url=url, timeout=120) as http:
        big = http.post("/v1/completions", json={"prompt": "hi", "n": 16, "max_tokens": 8150})
        assert big.status_code == 400, big.text
        msg = big.json()["error"]["message"]
        assert "KV budget" in msg and "4.00 GiB" in msg and "--kv-budget-gb" in msg, msg
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "max_tokens": 4})
        assert ok.status_code == 200


def test_a_client_leaving_during_a_long_prefill_frees_the_engine_within_one_chunk(server, default_engine):
    chunk = default_engine.runtime.prefill_chunk
    ids = torch.randint(100, 1000, (1, chunk), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    default_engine.runner.prefill(ids, 1, chunk + 1)
    t_chunk = time.perf_counter() - t0
    default_engine.runner.cache = None
    long_prompt = "def f(x):\n    return x + 1\n" * 400  # ~5,000 tokens: about ten chunks
    assert len(default_engine.tokenizer.encode(long_prompt)) > 8 * chunk
    with httpx.Client(base_url=server, timeout=120) as http:
        body = {"prompt": long_prompt, "max_tokens": 4, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body):
            time.sleep(max(0.5, t_chunk))  # the prefill is under way; now the client leaves
        left = time.perf_counter()
        nxt = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        waited = time.perf_counter() - left
    assert nxt.status_code == 200
    small = nxt.json()["laneplay"]
    served = (small["ttft_ms"] or 0) / 1000
    print(f"one prefill chunk: {t_chunk:.2f} s; the next request waited {waited:.2f} s ({served:.2f} s its own)")
    assert waited - served < 2 * t_chunk + 1.0  # not the ~8 chunks of prefill that were left


@pytest.mark.parametrize("max_rows", [1, 16])
def test_a_waiting_stream_says_queued_then_running(default_engine, max_rows):
    """One row per step: the second request waits its turn. Sixteen: it joins the first one's steps at
    the next step boundary, and says it shares them."""
    with (serve(create_app(default_engine, model_name=MODEL, max_rows=max_rows)) as url,
          httpx.Client(base_url=url, timeout=120) as http):
        def long_one():
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True})

        first = threading.Thread(target=long_one)
        first.start()
        deadline = time.monotonic() + 30
        while not http.get("/health").json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as s:
            comments = [line for line in s.iter_lines() if line.startswith(":")]
        first.join()
    shared = [": laneplay sharing 1"] if max_rows > 1 else []
    assert comments[0] == ": laneplay queued 1" and comments[2:] == shared, comments
    word, queue_ms = comments[1].rsplit(" ", 1)
    assert word == ": laneplay running" and float(queue_ms) >= 0  # the engine's wait, ms


def test_a_batch_request_says_how_it_ran(server):
    r = httpx.post(server + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "laneplay": {"priority": "batch"}})
    assert r.status_code == 200, r.text
    t, usage = r.json()["laneplay"], r.json()["usage"]
    assert t["priority"] == "batch" and t["rows_per_step"] == 1 and t["shared_with"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] % 512 == 0
