"""One client of our own engine's OpenAI-compatible API, for the app, the evaluations and the benchmarks.

- `api_base(url)`: the base URL rule (`http://host:8000`, with or without `/v1`, -> `http://host:8000`).
- `EngineClient` (async, httpx): `models()`, `health()`, `stream(body, chat)` -> `StreamEvent`s, and
  `complete(body, chat)` -> the whole reply. Used per call (each opens its own connection), or as
  `async with EngineClient(...) as client:` to keep one connection pool for many requests (the benches).
- `SyncEngineClient`: the same requests without an event loop (`laneplay eval`, the engine supervisor).
- The stream: SSE `data:` events, our SSE comments (`laneplay.protocol`: queued, running, sharing, and
  any other `: laneplay <word> ...`) and the final `laneplay` timing record. Any OpenAI-compatible server
  works (vLLM, llama.cpp's server): without our timing, `StreamTimer` times the stream on this side.
- Failures are `EngineError`s with one clear sentence (`kind`: "error", "busy", "invalid", "unreachable").
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Iterator

import httpx

from laneplay import protocol

COMPLETIONS, CHAT_COMPLETIONS, MODELS, HEALTH = "/v1/completions", "/v1/chat/completions", "/v1/models", "/health"


def api_base(url: str) -> str:
    """The server's root for any way of writing it: no trailing slash, no `/v1` (paths here carry it)."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint(chat: bool) -> str:
    return CHAT_COMPLETIONS if chat else COMPLETIONS


def streaming(body: dict) -> dict:
    """A request body asking for a stream that ends with the usage (and, from our engine, timing) chunk."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


class EngineError(Exception):
    """A request the engine could not serve; `message` is meant for the UI as is."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None,
                 kind: str = "error", cause: str | None = None):
        super().__init__(message)
        self.message, self.status, self.retry_after, self.kind = message, status, retry_after, kind
        self.cause = cause  # no HTTP answer: the transport error's name (ConnectError, ReadTimeout, ...)


def error_of(status: int, text: str, headers) -> EngineError:
    """An HTTP error answer (OpenAI's {"error": {...}} or anything else) as one sentence."""
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


def transport_error(e: httpx.HTTPError, base_url: str) -> EngineError:
    """A request that got no HTTP answer (or lost it half way) as one sentence."""
    if isinstance(e, httpx.ConnectError):
        message = f"The engine at {base_url} is not reachable (connection refused)."
    elif isinstance(e, httpx.TimeoutException):
        message = f"The engine at {base_url} did not answer in time."
    elif isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        message = "The connection to the engine broke off mid-answer (did it stop?)."
    else:
        message = f"The engine at {base_url} did not answer ({type(e).__name__}: {e})."
    return EngineError(message, kind="unreachable", cause=type(e).__name__)


@contextlib.contextmanager
def answered(base_url: str):
    """Around a request: an `httpx` transport error inside becomes an `EngineError` (`transport_error`)."""
    try:
        yield
    except httpx.HTTPError as e:
        raise transport_error(e, base_url) from None


def reply_json(r: httpx.Response) -> dict:
    """A whole reply's JSON, or its error as an `EngineError`."""
    if r.status_code != 200:
        raise error_of(r.status_code, r.text, r.headers)
    return r.json()


# ---- the stream ----------------------------------------------------------------------------------
@dataclass
class StreamEvent:
    kind: str  # "queued" | "running" | "sharing" | "delta" | "done", or another word of ours (see `args`)
    index: int = 0
    text: str = ""
    position: int | None = None  # queue position while queued; "sharing": how many other requests share the steps
    # "delta": {"finish_reason", "server": the engine's timing of a choice that just finished (or None)};
    # "done": the server's laneplay record of the whole request (or None)
    timing: dict | None = None
    usage: dict | None = None  # "done": the usage record, when the server sends one
    # "delta": the tokens whose text it carries, when the request asked for logprobs (`tokens_of`)
    tokens: list[dict] | None = None
    args: list[str] = field(default_factory=list)  # an SSE comment's words after its kind


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


def sse_line(line: str) -> tuple[str, str] | None:
    """One line of an SSE stream: ("comment", text) for `: text`, ("data", payload) for `data: payload`,
    None for anything else (blank separators, `event:`/`id:` fields)."""
    if line.startswith(":"):
        return "comment", line[1:].strip()
    if line.startswith("data:"):
        return "data", line[5:].strip()
    return None


def _int(word: str) -> int | None:
    try:
        return int(word)
    except ValueError:
        return None


class StreamDecoder:
    """Turns a completions or chat stream's SSE lines into `StreamEvent`s; `feed` a line at a time, and
    after the stream (or `[DONE]`, after which `done` is true) take `finish()`: the "done" event."""

    def __init__(self, chat: bool):
        self.chat, self.done = chat, False
        self.timing: dict | None = None
        self.usage: dict | None = None

    def feed(self, line: str) -> list[StreamEvent]:
        event = sse_line(line)
        if event is None or self.done:
            return []
        kind, payload = event
        if kind == "comment":
            return self._comment(payload)
        if payload == "[DONE]":
            self.done = True
            return []
        try:
            obj = json.loads(payload)
        except ValueError:
            raise EngineError("The engine sent a malformed stream event.") from None
        if not isinstance(obj, dict):
            raise EngineError("The engine sent a malformed stream event.")
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            raise EngineError(f"The engine failed: {err.get('message', 'unknown error')}")
        ours = obj.get("laneplay") if isinstance(obj.get("laneplay"), dict) else {}
        if "ttft_ms" in ours:
            self.timing = ours
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        finished = {t.get("index", 0): t for t in ours.get("per_choice") or [] if isinstance(t, dict)}
        out = []
        for choice in obj.get("choices") or []:
            text = ((choice.get("delta") or {}).get("content") if self.chat else choice.get("text")) or ""
            index = int(choice.get("index", 0))
            out.append(StreamEvent("delta", index=index, text=text,
                                   timing={"finish_reason": choice.get("finish_reason"), "server": finished.get(index)},
                                   tokens=tokens_of(choice.get("logprobs"))))
        return out

    @staticmethod
    def _comment(text: str) -> list[StreamEvent]:
        ours = protocol.parse_comment(text)
        if ours is None:
            return []
        word, args = ours
        if word in (protocol.QUEUED, protocol.SHARING):
            position = _int(args[-1]) if args else None
            if word == protocol.SHARING and position is None:
                return []
            return [StreamEvent(word, position=position, args=args)]
        return [StreamEvent(word, args=args)]

    def finish(self) -> StreamEvent:
        return StreamEvent("done", timing=self.timing, usage=self.usage)


def decode_lines(lines: Iterable[str], chat: bool) -> Iterator[StreamEvent]:
    """Every event of a whole stream's lines, "done" last."""
    decoder = StreamDecoder(chat)
    for line in lines:
        yield from decoder.feed(line)
        if decoder.done:
            break
    yield decoder.finish()


@dataclass
class ChoiceTiming:
    """What the meter shows for one choice; client-side numbers until the server's arrive."""
    tokens: int = 0
    ttft_ms: float | None = None
    decode_tps: float | None = None
    ms_per_token: float | None = None
    latencies_ms: list[float] = field(default_factory=list)  # gap between consecutive chunks
    finish_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None


class StreamTimer:
    """Client-side timing of a stream, per choice: used live, and as the result when the server sends none."""

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


# ---- the clients ---------------------------------------------------------------------------------
def _models_of(r: httpx.Response) -> list[dict] | None:
    """The entries of a /v1/models answer, or None when it is not one."""
    try:
        data = r.json().get("data") if r.status_code == 200 else None
    except (ValueError, AttributeError):
        return None
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else None


def _our_health(r: httpx.Response) -> dict | None:
    """Our engine's /health record (it has "status"), or None from another server."""
    try:
        h = r.json() if r.status_code == 200 else None
    except ValueError:
        return None
    return {**h, "laneplay": "queue_depth" in h} if isinstance(h, dict) and "status" in h else None


class _Base:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 connect_s: float | None = 5.0, limits: httpx.Limits | None = None):
        self.base_url = api_base(base_url)
        self.headers = auth_headers(api_key)
        self.timeout = httpx.Timeout(timeout_s, connect=connect_s)
        self.limits = limits or httpx.Limits()

    def _options(self) -> dict:
        return {"base_url": self.base_url, "headers": self.headers, "timeout": self.timeout, "limits": self.limits}


class EngineClient(_Base):
    """Async client; `base_url` like http://127.0.0.1:8000 (with or without /v1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http: httpx.AsyncClient | None = None  # kept open inside `async with`

    async def __aenter__(self) -> "EngineClient":
        self._http = httpx.AsyncClient(**self._options())
        return self

    async def __aexit__(self, *exc) -> None:
        http, self._http = self._http, None
        await http.aclose()

    @contextlib.asynccontextmanager
    async def _session(self):
        if self._http is not None:
            yield self._http
        else:
            async with httpx.AsyncClient(**self._options()) as http:
                yield http

    async def _get(self, path: str) -> httpx.Response:
        with answered(self.base_url):
            async with self._session() as http:
                return await http.get(path)

    async def models(self) -> list[str]:
        r = await self._get(MODELS)
        if r.status_code != 200:
            raise error_of(r.status_code, r.text, r.headers)
        return [m.get("id", "") for m in _models_of(r) or []]

    async def health(self) -> dict:
        """Our engine's /health; for other servers, a synthetic record built from /v1/models."""
        ours = _our_health(await self._get(HEALTH))
        if ours is not None:
            return ours
        models = await self.models()
        return {"status": "ok", "model": models[0] if models else "", "laneplay": False}

    async def complete(self, body: dict, chat: bool) -> dict:
        """One whole (non-streamed) completion: the reply's JSON."""
        with answered(self.base_url):
            async with self._session() as http:
                return reply_json(await http.post(endpoint(chat), json=body))

    async def stream(self, body: dict, chat: bool) -> AsyncIterator[StreamEvent]:
        """POST a streaming request; yields StreamEvents, "done" last. Closing the iterator closes the
        connection, which our engine takes as a cancel."""
        with answered(self.base_url):
            async with self._session() as http:
                async with http.stream("POST", endpoint(chat), json=streaming(body)) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise error_of(r.status_code, r.text, r.headers)
                    decoder = StreamDecoder(chat)
                    async for line in r.aiter_lines():
                        for ev in decoder.feed(line):
                            yield ev
                        if decoder.done:
                            break
                    yield decoder.finish()


class SyncEngineClient(_Base):
    """The same requests without an event loop; one connection pool until `close()` (or `with`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http = httpx.Client(**self._options())

    def __enter__(self) -> "SyncEngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str) -> httpx.Response:
        with answered(self.base_url):
            return self.http.get(path)

    def health(self) -> dict | None:
        """Our engine's /health record, or None when the server is not ours (or not ready: not 200)."""
        return _our_health(self._get(HEALTH))

    def models(self) -> list[dict]:
        """The /v1/models entries ({"id", "owned_by", ...}); an EngineError when it does not answer 200."""
        r = self._get(MODELS)
        models = _models_of(r)
        if models is None:
            raise error_of(r.status_code, r.text, r.headers)
        return models

    def complete(self, body: dict, chat: bool) -> dict:
        """One whole (non-streamed) completion: the reply's JSON."""
        with answered(self.base_url):
            return reply_json(self.http.post(endpoint(chat), json=body))

    def stream(self, body: dict, chat: bool) -> Iterator[StreamEvent]:
        with answered(self.base_url), self.http.stream("POST", endpoint(chat), json=streaming(body)) as r:
            if r.status_code != 200:
                r.read()
                raise error_of(r.status_code, r.text, r.headers)
            yield from decode_lines(r.iter_lines(), chat)
