"""The app's engine client and remote-engine watcher against a plain OpenAI-compatible server (no
`laneplay` timing field, no /health), the shape of vLLM's or llama.cpp's: text streams, timing is
taken on the app side, and failures are one clear sentence."""
import asyncio
import json
import socket

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from laneplay.api_client import EngineClient, EngineError, StreamTimer
from laneplay.app.supervisor import RemoteEngine

from .serving import serve


def other_server() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "some-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("max_tokens", 1) > 100:
            return JSONResponse({"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}},
                                status_code=400)
        if body.get("max_tokens") == 99:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "7"})

        async def events():
            for i, word in enumerate(["def", " add", "(a,", " b):", "\n    return a + b"]):
                await asyncio.sleep(0.02)
                chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield 'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def url():
    with serve(other_server()) as base:
        yield base


async def collect(client, body):
    timer, text, done = StreamTimer(), "", None
    async for ev in client.stream(body, chat=True):
        if ev.kind == "delta":
            timer.on_delta(ev.index, ev.text, (ev.timing or {}).get("finish_reason"))
            text += ev.text
        elif ev.kind == "done":
            done = ev
    return text, timer, done


def test_a_plain_openai_server_streams_and_is_timed_on_the_app_side(url):
    text, timer, done = asyncio.run(collect(EngineClient(url + "/v1"), {"messages": [{"role": "user", "content": "x"}],
                                                                        "max_tokens": 16}))
    assert text == "def add(a, b):\n    return a + b"
    assert done.timing is None  # no laneplay field: the meter says "app-side timing"
    c = timer.choices[0]
    assert c.tokens == 5 and c.ttft_ms > 0 and c.decode_tps > 0 and c.finish_reason == "stop"


def test_errors_are_one_clear_sentence(url):
    client = EngineClient(url)
    with pytest.raises(EngineError, match="max_tokens is too large") as bad:
        asyncio.run(collect(client, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}))
    assert bad.value.status == 400 and bad.value.kind == "invalid"
    with pytest.raises(EngineError, match="busy.*Retry in about 7 s") as busy:
        asyncio.run(collect(client, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 99}))
    assert busy.value.retry_after == 7.0 and busy.value.kind == "busy"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(EngineError, match="not reachable") as gone:
        asyncio.run(collect(EngineClient(dead), {"messages": [{"role": "user", "content": "x"}]}))
    assert gone.value.kind == "unreachable"


def test_a_remote_engine_without_our_health_endpoint_is_ready_by_its_model_list(url):
    eng = RemoteEngine(url + "/v1")
    eng.start()
    try:
        assert eng.wait_ready(10)
        assert eng.info["model"] == "some-model" and eng.info["laneplay"] is False
        assert eng.url == url
    finally:
        eng.stop()
