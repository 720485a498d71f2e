"""The live meter's HTML: one element per meter whose data-* attributes are always current.

The server renders it on every (throttled) update; `static/meter.js` draws the per-token latency
sparkline from `data-latencies` and keeps `elapsed` ticking between updates. Machine-readable:
`data-state` (loading | idle | queued | running | done | stopped | error: `stopped` is a run that
Stop ended, its numbers up to the stop; `error` has a note that says what failed), `data-tokens`, `data-tps`,
`data-ttft-ms` (from the click to the first token: the wait for the engine included), plus
`data-engine-ttft-ms` (the engine's own TTFT, from when it took the request), `data-queue-ms` (how long
the request waited for the engine), `data-sharing` (how many other requests shared the engine's steps
with it, now or at the end), `data-ms-per-token`, `data-elapsed-ms`, `data-source` ("server": the
engine's own timing; "app": timed here from the stream, for servers that send none), and while the engine
speculates (prompt lookup, engine/speculative.py) `data-accepted-per-step` (tokens per decode step) and
`data-acceptance` (accepted drafts / drafts): the engine's counts, live, then its final ones. Beside other
requests `auto` may hold its drafts back (engine.speculative.SHARED_KEEP): `data-drafting-paused` is
"1" while it does, and `data-paused-steps` counts the steps it did.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

STATES = ("loading", "idle", "queued", "running", "done", "stopped", "error")
STATE_TITLES = {"stopped": "ended by Stop: the numbers cover what ran up to the stop",
                "done": "the engine finished this request"}
MAX_SPARK_POINTS = 160


@dataclass
class MeterData:
    state: str = "idle"
    tokens: int = 0
    tps: float | None = None
    ttft_ms: float | None = None  # from the click: the wait included
    engine_ttft_ms: float | None = None  # the engine's own, from when it took the request
    queue_ms: float | None = None
    sharing: int | None = None  # other requests in the engine's steps
    accepted_per_step: float | None = None  # speculation: tokens per decode step after the first token
    acceptance: float | None = None  # speculation: accepted draft tokens / draft tokens
    paused_steps: int | None = None  # speculation: steps beside other requests that held the drafts back
    speculation_paused: bool = False  # ... and whether it does now
    ms_per_token: float | None = None
    elapsed_ms: float = 0.0
    device: str | None = None
    dtype: str | None = None  # the weight path that runs (int4, float32, ...)
    world_size: int | None = None
    latencies_ms: list[float] = field(default_factory=list)
    source: str = "server"
    note: str = ""  # queue position, finish reason, engine stage, ...


def of_stored(g: dict, note: str | None = None) -> MeterData:
    """The meter of a stored generation: `stopped` when Stop ended it, else `done`; `note`, else its finish."""
    stopped = g.get("finish_reason") == "cancelled"
    return MeterData(state="stopped" if stopped else "done", tokens=g["completion_tokens"] or 0,
                     tps=g["decode_tokens_per_second"], ttft_ms=g["ttft_ms"], ms_per_token=g["ms_per_token"],
                     device=g["device"], world_size=g["world_size"],
                     note=note if note is not None else f"finish: {g['finish_reason'] or '–'}")


def _ttft_sub(d: MeterData) -> str:
    """Under the TTFT (from the click): the wait and the engine's own TTFT, when they differ from it."""
    parts = []
    if d.queue_ms is not None and d.queue_ms >= 1:
        parts.append(f"waited {d.queue_ms:.0f} ms")
    if d.engine_ttft_ms is not None and (d.ttft_ms is None or abs(d.ttft_ms - d.engine_ttft_ms) >= 1):
        parts.append(f"engine {d.engine_ttft_ms:.0f} ms")
    return " · ".join(parts)


def _ttft_title(d: MeterData) -> str:
    return ("time to first token from the click, the wait for the engine included; the engine's own TTFT "
            "counts from when it took the request")


def _title(text: str) -> str:
    return f' title="{html.escape(text, quote=True)}"'


def _spec_sub(d: MeterData) -> list[str]:
    """Under tokens/s while the engine speculates, a line each: tokens per step and how many drafts it kept,
    then whether (or for how many steps) sharing the engine held its drafts back."""
    if d.accepted_per_step is None:
        return []
    kept = f" · {100 * d.acceptance:.0f}% kept" if d.acceptance is not None else ""
    lines = [f"{d.accepted_per_step:.2f} tokens/step{kept}"]
    if d.speculation_paused:
        lines.append("drafting paused while sharing")
    elif d.paused_steps:
        lines.append(f"paused {d.paused_steps} step{'s' if d.paused_steps > 1 else ''} while sharing")
    return lines


_KEPT_TITLE = ("speculation: tokens per decode step, and the share of draft tokens (from prompt lookup) that "
               "the model kept")


_PAUSED_TITLE = ("beside other requests, speculation (auto) holds its drafts back in steps where another request "
                 "does not draft (unless it keeps nearly all of them, in a step of 3 or 4 requests) or while it "
                 "keeps few of them: otherwise the others would wait for its draft rows")


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def render(d: MeterData, elem_id: str = "meter", compact: bool = False, resting: bool = False) -> str:
    """The meter element. `resting`: no request behind it; meter.js then keeps its state in step with
    the engine's (`loading` until the engine is ready, then `idle`)."""
    assert d.state in STATES, d.state
    lat = d.latencies_ms[-MAX_SPARK_POINTS:]
    where = ""
    if d.device:
        where = f"{d.device} × {d.world_size}" if d.world_size else d.device
        if d.dtype:
            where += f" · {d.dtype}"
    attrs = {
        "id": elem_id, "class": "lp-meter" + (" lp-compact" if compact else ""), "data-state": d.state,
        "data-tokens": str(d.tokens), "data-tps": "" if d.tps is None else f"{d.tps:.2f}",
        "data-ttft-ms": "" if d.ttft_ms is None else f"{d.ttft_ms:.1f}",
        "data-engine-ttft-ms": "" if d.engine_ttft_ms is None else f"{d.engine_ttft_ms:.1f}",
        "data-queue-ms": "" if d.queue_ms is None else f"{d.queue_ms:.0f}",
        "data-sharing": "" if d.sharing is None else str(d.sharing),
        "data-accepted-per-step": "" if d.accepted_per_step is None else f"{d.accepted_per_step:.3f}",
        "data-acceptance": "" if d.acceptance is None else f"{d.acceptance:.3f}",
        "data-drafting-paused": "1" if d.speculation_paused else "",
        "data-paused-steps": "" if d.paused_steps is None else str(d.paused_steps),
        "data-ms-per-token": "" if d.ms_per_token is None else f"{d.ms_per_token:.2f}",
        "data-elapsed-ms": f"{d.elapsed_ms:.0f}", "data-source": d.source, "data-dtype": d.dtype or "",
        "data-latencies": ",".join(f"{x:.1f}" for x in lat),
    }
    if resting:
        attrs["data-resting"] = "1"
    a = " ".join(f'{k}="{html.escape(v, quote=True)}"' for k, v in attrs.items())
    cells = [("TTFT", _num(d.ttft_ms, ".0f") + " ms", "ttft"), ("tokens/s", _num(d.tps, ".1f"), "tps"),
             ("ms/token", _num(d.ms_per_token, ".1f"), "mspt"), ("tokens", str(d.tokens), "tokens")]
    if not compact:
        cells += [("elapsed", f"{d.elapsed_ms / 1000:.1f} s", "elapsed"), ("runs on", where or "–", "where")]
    titles = {"where": where or "–", "ttft": _ttft_title(d)}
    body = "".join(f'<div class="lp-cell lp-{key}"><span class="lp-k">{k}</span>'
                   f'<span class="lp-v"{_title(titles[key]) if titles.get(key) else ""}>{html.escape(v)}</span>'
                   + (f'<span class="lp-sub">{html.escape(_ttft_sub(d))}</span>' if key == "ttft" and _ttft_sub(d) else "")
                   + ("".join(f'<span class="lp-sub lp-spec"{_title(_PAUSED_TITLE if j else _KEPT_TITLE)}>'
                              f'{html.escape(line)}</span>' for j, line in enumerate(_spec_sub(d))) if key == "tps" else "")
                   + '</div>' for k, v, key in cells)
    why = ("the engine's timing of a stopped request did not arrive: timed here, from the stream"
           if d.state == "stopped" else "the server sent no timing: timed here, from the stream")
    source = "" if d.source == "server" else f'<span class="lp-src"{_title(why)}>app-side timing</span>'
    note = f'<span class="lp-note">{html.escape(d.note)}</span>' if d.note else ""
    state_title = _title(STATE_TITLES[d.state]) if d.state in STATE_TITLES else ""
    return (f'<div {a}><div class="lp-head"><span class="lp-state"{state_title}>{d.state}</span>{note}{source}</div>'
            f'<div class="lp-cells">{body}</div><svg class="lp-spark" viewBox="0 0 200 36" preserveAspectRatio="none">'
            f'</svg></div>')
