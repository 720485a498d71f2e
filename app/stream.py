"""One generation's stream, from the engine to the page: the component every generating tab uses.

A `Generation` owns one run's columns (one per choice: its text, its meter, how it finished, the
engine's timing once sent) and the engine streams that fill them. It waits for a loading engine
(saying so), routes the client's events to their columns, keeps each meter live with the app's timing
of the stream, and replaces that timing with the engine's own as soon as the engine sends it (a
choice's finishing chunk, then the request's final record); without it the meter says its numbers were
timed here (`source` "app"). `Pages` says which generation may run in each page (owner + Gradio
session): a newer Generate supersedes the older one, Stop ends it; the generation notices within 0.1 s
and closes its streams, which the engine takes as a cancel.

How a column ends (`finish`): `done` (the engine finished it), `stopped` (Stop ended it: its timing up
to the stop, the engine's when it came, else the app's, labelled so), `error` (the meter's note says
what failed; `failure` says it in a sentence for the page's error line).

Playground, Side by side and the DTP view render a Generation's columns; the pass@N jobs gather them
(`collect`).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from laneplay.api_client import EngineError, StreamEvent, StreamTimer
from laneplay.protocol import SPECULATIVE
from laneplay.app.meter import MeterData

UPDATE_EVERY_S = 0.1  # at most ten page updates a second while tokens stream
ENGINE_WAIT_S = 600.0  # a generation waits this long for a loading engine before giving up
FAILED = {"busy": "failed: engine busy", "unreachable": "failed: engine unreachable",
          "invalid": "failed: the engine refused the request", "error": "failed: engine error"}

Request = tuple[int | None, dict, bool]  # (column, or None for one request whose choices are the columns; body; chat?)


# ---- which generation may run in a page --------------------------------------------------------------

class Pages:
    """The one generation that may run in each page (owner + Gradio session, see `playground.page_key`)."""

    def __init__(self):
        self._current: dict = {}
        self._ids = itertools.count(1)

    def begin(self, page) -> "Ticket":
        """A new generation of `page`; the one running there before sees it is superseded and ends."""
        ticket = Ticket(self, page, next(self._ids))
        self._current[page] = ticket.id
        return ticket

    def stop(self, page) -> None:
        """Stop: the running generation of `page` ends within 0.1 s and says `stopped`."""
        self._current.pop(page, None)


@dataclass
class Ticket:
    pages: Pages
    page: object
    id: int

    def wanted(self) -> bool:
        return self.pages._current.get(self.page) == self.id

    def superseded(self) -> bool:
        """A newer generation of the page took over (rather than Stop, or nothing)."""
        return not self.wanted() and self.page in self.pages._current

    def end(self) -> None:
        if self.wanted():
            del self.pages._current[self.page]


# ---- the engine's stream -----------------------------------------------------------------------------

async def stream_to(ctx, body: dict, chat: bool, put) -> None:
    """The engine's stream into `put` (an async callable): StreamEvents, or an EngineError, then None.
    Run it in a task of its own so that Stop never waits for a token; cancelling the task closes the
    stream, which the engine takes as a cancel. An engine that was just restarted may refuse the first
    connection: that is waited for, once."""
    for attempt in (1, 2):
        got_any = False
        try:
            async for item in ctx.client().stream(body, chat):
                got_any = True
                await put(item)
        except EngineError as e:
            if attempt == 1 and not got_any and e.kind == "unreachable":
                for _ in range(60):
                    await asyncio.sleep(0.5)
                    if ctx.engine.ready:
                        break
                continue
            await put(e)
        break
    await put(None)


async def engine_ready(engine, wanted: Callable[[], bool] = lambda: True,
                       wait_s: float = ENGINE_WAIT_S) -> AsyncIterator[str]:
    """Waits for a loading or restarting engine, yielding what it is doing every half second; ends at
    once when it is ready or `wanted()` turns false; raises EngineError after `wait_s`."""
    waited = time.monotonic()
    while not engine.ready and wanted():
        if time.monotonic() - waited > wait_s:
            raise EngineError(f"The engine is not ready ({engine.state}: {engine.detail}).", kind="unreachable")
        yield f"{engine.state}: {engine.detail}"
        await asyncio.sleep(0.5)


# ---- one generation ----------------------------------------------------------------------------------

def speculation(drafts: int, accepted: int, steps: int, tokens: int) -> tuple[float | None, float | None]:
    """(tokens per decode step, accepted drafts / drafts) from the engine's counts: its steps after the first
    token (plain ones and verifies) and the tokens they gave."""
    return ((tokens - 1) / steps if steps else None), (accepted / drafts if drafts else None)


def _float(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) and x >= 0 else None


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) < 19 else None


def _sharing_note(others: int | None) -> str:
    if not others:
        return ""
    return f"sharing the engine with {others} other request{'s' if others > 1 else ''}"


@dataclass
class Column:
    """One choice of a generation as its stream fills it."""
    settings: dict = field(default_factory=dict)
    text: str = ""
    meter: MeterData = field(default_factory=lambda: MeterData(state="queued"))
    finish: str | None = None  # the engine's finish reason; "cancelled" when Stop ended it
    server: dict | None = None  # the engine's timing of this choice, once sent
    prompt_tokens: int = 0
    tokens: list[dict] = field(default_factory=list)  # with logprobs: its tokens (api_client.tokens_of), in order

    def take_server(self, t: dict, request: dict | None = None) -> None:
        """The engine's timing is the final word on speed: it replaces the app's (`request`: the
        request's record, for where it ran and how long it waited). The TTFT the meter shows stays the
        one from the click (the wait included); the engine's own sits beside it."""
        m = self.meter
        self.server = t
        m.engine_ttft_ms = t.get("ttft_ms", m.engine_ttft_ms)
        m.tps = t.get("decode_tokens_per_second", m.tps)
        m.ms_per_token = t.get("ms_per_token", m.ms_per_token)
        m.tokens = t.get("completion_tokens") or m.tokens
        m.source = "server"
        for name in ("device", "dtype", "world_size"):
            setattr(m, name, (request or {}).get(name, getattr(m, name)))
        if request and request.get("queue_ms") is not None:
            m.queue_ms = request["queue_ms"]
        if request and request.get("shared_with") is not None:
            m.sharing = request["shared_with"] if m.sharing is None else max(m.sharing, request["shared_with"])
        if t.get("speculative") == "lookup" and t.get("decode_steps") is not None:  # its final speculation counts
            m.accepted_per_step, m.acceptance = speculation(t.get("draft_tokens") or 0, t.get("accepted_tokens") or 0,
                                                            t["decode_steps"], t.get("completion_tokens") or 0)
            m.paused_steps, m.speculation_paused = t.get("paused_steps", m.paused_steps), False
        if m.ttft_ms is None and m.engine_ttft_ms is not None:  # no text came: the engine's, plus the wait
            m.ttft_ms = m.engine_ttft_ms + (m.queue_ms or 0.0)

    def stored(self, index: int) -> dict:
        """The generation record storage keeps (the timing as the meter ends with it)."""
        m = self.meter
        return {"sample_index": index, "text": self.text, "finish_reason": self.finish or "stop",
                "completion_tokens": (self.server or {}).get("completion_tokens") or m.tokens,
                "prompt_tokens": self.prompt_tokens,
                "ttft_ms": m.engine_ttft_ms if m.engine_ttft_ms is not None else m.ttft_ms,  # the engine's speed
                "decode_tokens_per_second": m.tps,
                "ms_per_token": m.ms_per_token, "device": m.device or None, "world_size": m.world_size or None}


@dataclass
class Generation:
    """One run's columns and the streams that fill them."""
    columns: list[Column]
    timer: StreamTimer = field(default_factory=StreamTimer)
    timing: dict | None = None  # the request's own record (one request for all columns), once sent
    error: EngineError | None = None
    failure: str | None = None  # what failed, for the page's error line
    cancelled: bool = False

    @classmethod
    def of(cls, n: int, **settings) -> "Generation":
        return cls([Column(dict(settings)) for _ in range(n)])

    def route(self, col: int | None, ev: StreamEvent) -> None:
        """One stream event into its column(s). `col`: the column of a per-column request, None for one
        request whose deltas go by the choice's `index` and whose other events concern every column."""
        n = len(self.columns)
        index = _count(ev.args[0]) if ev.kind == SPECULATIVE and ev.args else ev.index  # a choice's own event
        if index is None:
            return  # a comment that is not ours to read
        mine = ev.kind in ("delta", SPECULATIVE)
        targets = range(n) if col is None and not mine else [index if col is None else col]
        for i in (i for i in targets if 0 <= i < n):
            c, m = self.columns[i], self.columns[i].meter
            if ev.kind == "queued":
                m.state, m.note = "queued", f"position {ev.position} in the engine's queue"
            elif ev.kind == "running" and m.state == "queued":
                m.state, m.note = "running", "prefill"
                # the engine's own wait (our server says it when it starts the request), else the app's
                m.queue_ms = _float(ev.args[0]) if ev.args else None
                if m.queue_ms is None:
                    m.queue_ms = self.timer.elapsed_ms()
            elif ev.kind == "sharing":
                m.sharing = ev.position
                if m.state == "running" and not c.finish:
                    m.note = _sharing_note(ev.position)
            elif ev.kind == SPECULATIVE and len(ev.args) >= 5:  # the choice's live counts
                counts = [_count(a) for a in ev.args[1:7]]
                if None in counts:  # not numbers: not a comment of ours to read
                    continue
                m.accepted_per_step, m.acceptance = speculation(*counts[:4])
                if len(counts) >= 6:  # beside other requests "auto" may hold its drafts back for a while
                    m.paused_steps, m.speculation_paused = counts[4], counts[5] == 1
            elif ev.kind == "delta":
                t = self.timer.on_delta(i, ev.text, (ev.timing or {}).get("finish_reason"))
                c.text += ev.text
                c.tokens += ev.tokens or []
                c.finish = t.finish_reason or c.finish
                m.tokens, m.tps, m.ttft_ms, m.ms_per_token, m.latencies_ms = \
                    t.tokens, t.decode_tps, t.ttft_ms, t.ms_per_token, t.latencies_ms
                if (ev.timing or {}).get("server"):
                    c.take_server(ev.timing["server"])
                m.state, m.note = ("done", f"finish: {c.finish}") if c.finish else ("running", _sharing_note(m.sharing))
            elif ev.kind == "done":
                c.prompt_tokens = (ev.usage or {}).get("prompt_tokens") or 0
                mine = [t for t in (ev.timing or {}).get("per_choice") or []
                        if t.get("index", 0) == (i if col is None else 0)]
                if mine:
                    c.take_server(mine[0], ev.timing)
        if ev.kind == "done" and col is None:
            self.timing = ev.timing
        for c in self.columns:
            c.meter.elapsed_ms = self.timer.elapsed_ms()

    def fail(self, error: EngineError, col: int | None, engine=None) -> None:
        self.error = error
        self.failure = error.message if col is None else f"Column {col + 1}: {error.message}"
        if error.kind == "unreachable" and engine is not None and not engine.ready:
            self.failure += f" The engine is {engine.state}: {engine.detail}."

    def finish(self) -> str | None:
        """Every column's final state (done, stopped or error); returns the failure, if any."""
        for c in self.columns:
            m = c.meter
            m.elapsed_ms = self.timer.elapsed_ms()
            if self.failure is not None:
                m.state, m.note = "error", FAILED.get(self.error.kind if self.error else "error", FAILED["error"])
                continue
            m.source = "server" if c.server is not None else "app"
            if self.cancelled and not c.finish:
                c.finish, m.state, m.note = "cancelled", "stopped", "ended by Stop"
            else:
                m.state, m.note = "done", f"finish: {c.finish or 'stop'}"
        return self.failure

    def decode_s(self) -> float | None:
        """Decode wall time of the whole run: the engine's (last token - first token), else the app's."""
        t = self.timing
        if t and t.get("total_ms") is not None and t.get("ttft_ms") is not None:
            return max(t["total_ms"] - t["ttft_ms"], 0.0) / 1000 or None
        timed = [c for c in self.timer.choices.values() if c.t_first is not None]
        if not timed:
            return None
        return (max(c.t_last for c in timed) - min(c.t_first for c in timed)) or None

    async def run(self, ctx, requests: list[Request] | Callable[[dict], list[Request]],
                  wanted: Callable[[], bool] = lambda: True) -> AsyncIterator[None]:
        """Streams `requests` (all at once; a callable makes them from the engine's info once it is ready)
        into the columns; yields when the page should show them (every signal; deltas at most ten times
        a second). Ends when every stream has, at the first failure, or as soon as `wanted()` turns false
        (Stop, a newer Generate): then the streams are closed. Call `finish()` after it."""
        try:
            async for note in engine_ready(ctx.engine, wanted):
                for c in self.columns:
                    c.meter.state, c.meter.note = "loading", note
                yield
        except EngineError as e:
            self.fail(e, None)
            return
        if not wanted():
            self.cancelled = True
            return
        info = getattr(ctx.engine, "info", None) or {}
        for c in self.columns:
            c.meter = MeterData(state="queued", device=info.get("device"), dtype=info.get("dtype"),
                                world_size=info.get("world_size"),
                                source="server" if info.get("laneplay", True) else "app")
        yield
        async for _ in self._stream(ctx, requests(info) if callable(requests) else requests, wanted):
            yield

    async def _stream(self, ctx, requests: list[Request], wanted) -> AsyncIterator[None]:
        events: asyncio.Queue = asyncio.Queue()

        def put_for(col):
            async def put(item):
                await events.put((col, item))
            return put

        readers = [asyncio.create_task(stream_to(ctx, body, chat, put_for(col))) for col, body, chat in requests]
        open_streams, last_push = len(readers), 0.0
        try:
            while open_streams:
                try:
                    col, ev = await asyncio.wait_for(events.get(), 0.1)
                except asyncio.TimeoutError:
                    col, ev = None, False
                if not wanted():
                    self.cancelled = True
                    return
                if ev is False:
                    continue
                if ev is None:
                    open_streams -= 1
                    continue
                if isinstance(ev, EngineError):
                    self.fail(ev, col, ctx.engine)
                    return
                self.route(col, ev)
                now = time.monotonic()
                if ev.kind != "delta" or now - last_push >= UPDATE_EVERY_S:
                    last_push = now
                    yield
        finally:  # done, Stop, or the page went away: the streams are closed either way
            for r in readers:
                r.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def collect(ctx, body: dict, chat: bool, n: int) -> Generation:
    """One request of n choices, streamed to its end and finished (no page to show it to); raises the
    engine's EngineError."""
    g = Generation.of(n)
    async for _ in g.run(ctx, [(None, body, chat)]):
        pass
    g.finish()
    if g.error is not None:
        raise g.error
    return g
