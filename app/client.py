"""One async client for the engine's OpenAI-compatible API, used by every tab.

It streams `/v1/completions` or `/v1/chat/completions` (SSE) and turns what comes back into
`StreamEvent`s: text deltas per choice, the queue/running signals our engine sends as SSE comments,
and the final timing. Any OpenAI-compatible server works (vLLM, llama.cpp's server): without our
`laneplay` timing field, the timing is taken here, on the app side, from the stream itself, and the
events say so (`server_timing=False`). Failures become `EngineError`s with one clear sentence.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx


class EngineError(Exception):
    """A request the engine could not serve; `message` is meant for the UI as is."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None,
                 kind: str = "error"):
        super().__init__(message)
        self.message, self.status, self.retry_after, self.kind = message, status, retry_after, kind


@dataclass
class ChoiceTiming:
    """What the meter shows for one choice; app-side numbers until the server's arrive."""
    tokens: int = 0
    ttft_ms: float | None = None
    decode_tps: float | None = None
    ms_per_token: float | None = None
    latencies_ms: list[float] = field(default_factory=list)  # gap between consecutive chunks
    finish_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None


@dataclass
class StreamEvent:
    kind: str  # "queued" | "running" | "sharing" | "delta" | "done"
    index: int = 0
    text: str = ""
    position: int | None = None  # queue position while queued; "sharing": how many other requests share the steps
    # "delta": {"finish_reason", "server": the engine's timing of a choice that just finished (or None)};
    # "done": the server's laneplay record of the whole request (or None)
    timing: dict | None = None
    usage: dict | None = None  # "done": the usage record, when the server sends one
    # "delta": the tokens whose text it carries, when the request asked for logprobs (`tokens_of`)
    tokens: list[dict] | None = None


def tokens_of(logprobs) -> list[dict] | None:
    """A choice's `logprobs` in either of OpenAI's shapes (chat: {"content": [...]}, completions: {"tokens",
    "token_logprobs", "top_logprobs"}) as [{"token", "logprob", "top": [{"token", "logprob"}]}]; None when
    the choice carries none."""
    if not isinstance(logprobs, dict):
        return None
    if "content" in logprobs:
        return [{"token": t.get("token", ""), "logprob": t.get("logprob"),
                 "top": [{"token": a.get("token", ""), "logprob": a.get("logprob")} for a in t.get("top_logprobs") or []]}
                for t in logprobs.get("content") or [] if isinstance(t, dict)]
    tops = logprobs.get("top_logprobs") or []
    return [{"token": t, "logprob": lp,
             "top": [{"token": k, "logprob": v} for k, v in ((tops[i] if i < len(tops) else None) or {}).items()]}
            for i, (t, lp) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))]


class EngineClient:
    """Async client; `base_url` like http://127.0.0.1:8000 (with or without /v1)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        base = base_url.rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.headers = headers
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout)

    async def models(self) -> list[str]:
        async with self._client() as http:
            r = await http.get("/v1/models")
            if r.status_code != 200:
                raise self._error(r.status_code, r.text, r.headers)
            return [m.get("id", "") for m in r.json().get("data", [])]

    async def health(self) -> dict:
        """Our engine's /health; for other servers, a synthetic record built from /v1/models."""
        async with self._client() as http:
            r = await http.get("/health")
            if r.status_code == 200 and isinstance(r.json(), dict) and "status" in r.json():
                return {**r.json(), "laneplay": "queue_depth" in r.json()}
        models = await self.models()
        return {"status": "ok", "model": models[0] if models else "", "laneplay": False}

    async def stream(self, body: dict, chat: bool) -> AsyncIterator[StreamEvent]:
        """POST a streaming request; yields StreamEvents. Closing the iterator closes the connection,
        which our engine takes as a cancel."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self._client() as http:
                async with http.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise self._error(r.status_code, r.text, r.headers)
                    async for ev in self._events(r, chat):
                        yield ev
        except httpx.ConnectError:
            raise EngineError(f"The engine at {self.base_url} is not reachable (connection refused).",
                              kind="unreachable") from None
        except httpx.TimeoutException:
            raise EngineError(f"The engine at {self.base_url} did not answer in time.", kind="unreachable") from None
        except (httpx.RemoteProtocolError, httpx.ReadError):
            raise EngineError("The connection to the engine broke off mid-answer (did it stop?).",
                              kind="unreachable") from None

    async def _events(self, r: httpx.Response, chat: bool) -> AsyncIterator[StreamEvent]:
        timing = usage = None
        async for kind, payload in _aiter_sse(r):
            if kind == "comment":
                if payload.startswith("laneplay queued"):
                    try:
                        pos = int(payload.split()[-1])
                    except ValueError:
                        pos = None
                    yield StreamEvent("queued", position=pos)
                elif payload == "laneplay running":
                    yield StreamEvent("running")
                elif payload.startswith("laneplay sharing"):
                    try:
                        yield StreamEvent("sharing", position=int(payload.split()[-1]))
                    except ValueError:
                        pass
                continue
            if payload == "[DONE]":
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                raise EngineError("The engine sent a malformed stream event.") from None
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                raise EngineError(f"The engine failed: {err.get('message', 'unknown error')}")
            ours = obj.get("laneplay") if isinstance(obj.get("laneplay"), dict) else {}
            if "ttft_ms" in ours:
                timing = ours
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            finished = {t.get("index", 0): t for t in ours.get("per_choice") or [] if isinstance(t, dict)}
            for choice in obj.get("choices") or []:
                if chat:
                    text = (choice.get("delta") or {}).get("content") or ""
                else:
                    text = choice.get("text") or ""
                index = int(choice.get("index", 0))
                yield StreamEvent("delta", index=index, text=text, position=None,
                                  timing={"finish_reason": choice.get("finish_reason"), "server": finished.get(index)},
                                  tokens=tokens_of(choice.get("logprobs")))
        yield StreamEvent("done", timing=timing, usage=usage)

    @staticmethod
    def _error(status: int, text: str, headers) -> EngineError:
        try:
            err = json.loads(text).get("error") or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            message = None
        message = message or (text.strip()[:300] or f"HTTP {status}")
        if status == 429:
            retry = headers.get("Retry-After")
            try:
                retry_s = float(retry) if retry is not None else None
            except ValueError:
                retry_s = None
            hint = f" Retry in about {retry_s:.0f} s." if retry_s else ""
            return EngineError(f"The engine is busy: {message}.{hint}", status=429, retry_after=retry_s, kind="busy")
        if status in (401, 403):
            return EngineError(f"The engine refused the API key ({status}): {message}", status=status)
        if 400 <= status < 500:
            return EngineError(message, status=status, kind="invalid")
        return EngineError(f"The engine failed ({status}): {message}", status=status)


async def _aiter_sse(r: httpx.Response):
    async for line in r.aiter_lines():
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("data:"):
            yield "data", line[5:].strip()


class StreamTimer:
    """App-side timing of a stream, per choice: used live, and as the result when the server sends none."""

    def __init__(self):
        self.t_start = time.perf_counter()
        self.choices: dict[int, ChoiceTiming] = {}

    def on_delta(self, index: int, text: str, finish_reason: str | None) -> ChoiceTiming:
        c = self.choices.setdefault(index, ChoiceTiming())
        now = time.perf_counter()
        if text:
            if c.t_first is None:
                c.t_first = now
                c.ttft_ms = (now - self.t_start) * 1000
            elif c.t_last is not None:
                c.latencies_ms.append((now - c.t_last) * 1000)
            c.t_last = now
            c.tokens += 1  # one chunk per token from our engine; other servers may batch (an estimate)
            if c.tokens > 1 and c.t_last > c.t_first:
                c.decode_tps = (c.tokens - 1) / (c.t_last - c.t_first)
                c.ms_per_token = 1000 / c.decode_tps
        if finish_reason:
            c.finish_reason = finish_reason
        return c

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t_start) * 1000
