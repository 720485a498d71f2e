"""The DTP tab: delayed collectives against "wait now" on the running engine, step by step and rank by rank.

A/B runs the Playground's prompt (editor, instruction, mode) twice, greedy and with a fixed token count:
first with DTP's delayed collectives, then with every collective waited for where it is issued (the same
function, with the communication exposed). Each run is one request with the engine's `laneplay`
extension, {"collectives": ..., "timeline": true}, and streams into its own meter (`#dtp-meter-delayed`,
`#dtp-meter-wait`). Its final `laneplay` record carries every rank's timeline, drawn as an inline SVG
(`#dtp-timeline`: one row per mode and rank, each decode step split into compute, issuing, delayed waits,
"wait now" waits and blocking collectives) and summed up in `#dtp-table` (per mode: ms/token, tokens/s,
per-token exposed / waited / blocking ms of each rank, and the share of communication that the delay hid).

Beside it, `#dtp-prediction`: the performance model's estimate for 8×H200 (laneplay/perfmodel.py), for the
served model when it splits over 8 GPUs, else for Laneformer 2B, saying which. An A/B is a measurement,
not a generation of the session: nothing is stored.

The view needs a Laneplay engine (the extension and the timeline are ours) running at a world size of 2
or more that divides the served model (`laneplay serve --world-size auto` picks one); otherwise it says
so, with the sizes that would do, and A/B is off.
"""
from __future__ import annotations

import asyncio
import html
from dataclasses import dataclass, field

import gradio as gr
from laneplay.app import playground
from laneplay.api_client import EngineError
from laneplay.app.context import (
    AppContext,
    InputError,
    check_texts,
    request_body,
    sampling,
)
from laneplay.app.meter import MeterData, render
from laneplay.app.quota import Limited
from laneplay.app.stream import Generation, engine_ready
from laneplay.app.supervisor import world_sizes

MODES = (("delayed", "delayed (DTP)", "dtp-meter-delayed"), ("wait_now", "wait now (exposed)", "dtp-meter-wait"))
LABELS = {collectives: label for collectives, label, _ in MODES}
DEFAULT_MAX_TOKENS = 64
MAX_AB_TOKENS = 512
NODE = "8xH200"
COLORS = {"compute": "#94a3b8", "issued": "#2563eb", "waited": "#f59e0b", "exposed": "#dc2626",
          "blocking": "#7c3aed"}
LEGEND = {"compute": "compute", "issued": "issuing collectives", "waited": "waiting (delayed)",
          "exposed": "waiting (wait now)", "blocking": "blocking collectives"}


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


# ---- is the view usable? ------------------------------------------------------------------------------

def availability(ctx: AppContext) -> tuple[bool | None, str]:
    """(True: A/B can run, False: it cannot on this engine, None: not known yet), and what to tell the user."""
    e = ctx.engine
    info = e.info or {}
    if not e.ready:
        return None, f"The engine is {e.state} ({e.detail}); A/B waits for it."
    if not info.get("laneplay", True):
        return False, ("The DTP view needs a Laneplay engine: the server at the engine URL does not speak "
                       "Laneplay's extension (per-request collectives and per-rank timelines), so there is "
                       "nothing to compare. Run `laneplay serve --world-size auto` (or point --engine-url at a "
                       "`laneplay engine --world-size N` whose N divides the model).")
    ws = int(info.get("world_size") or 1)
    if ws < 2:
        return False, "This engine runs at world size 1: all lanes in one process, so there are no collectives " \
                      "to delay or expose. " + how_to_split(info)
    return True, (f"{info.get('model')} on {info.get('device')} × {ws} DTP ranks. A/B runs the Playground's prompt "
                  "twice, greedy: delayed collectives, then wait-now.")


def how_to_split(info: dict) -> str:
    """Which `laneplay serve --world-size` starts a local engine this model splits over, from the sizes that
    divide it (the engine's /health model config)."""
    sizes, model = world_sizes(info.get("model_config")), info.get("model") or "the served model"
    if sizes is None:
        return ("Run `laneplay serve --world-size auto` to start a local engine with DTP ranks (CPU works): it "
                "picks a size that divides the model, then come back here.")
    if not sizes:
        return (f"No world size from 2 to 8 divides {model} (a Llama model's attention heads, key-value heads and "
                "MLP width; a Laneformer's lanes), so it cannot run DTP: serve a model that splits, e.g. a "
                "Laneformer checkpoint.")
    listed = ", ".join(map(str, sizes))
    return (f"The sizes that divide {model}: {listed}. Run `laneplay serve --world-size {sizes[0]}` (or "
            f"`--world-size auto`) to start a local engine with {sizes[0]} DTP ranks (CPU works), then come back "
            "here.")


def status_html(ctx: AppContext) -> str:
    ok, message = availability(ctx)
    state = {True: "ready", False: "unavailable", None: "waiting"}[ok]
    ws = (ctx.engine.info or {}).get("world_size")
    cls = "lp-dtp-status" + (" lp-dtp-off" if ok is False else "")
    return (f'<div id="dtp-status" class="{cls}" data-state="{state}" data-world-size="{_esc(ws or "")}">'
            f'{_md_code(message)}</div>')


def _md_code(text: str) -> str:
    """`x` as <code>x</code>, the rest escaped."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


# ---- the requests -------------------------------------------------------------------------------------

def ab_requests(mode: str, code: str, instruction: str, max_tokens: int) -> list[tuple[str, dict, bool]]:
    """(collectives, body, chat?) for the two runs: the same greedy request, delayed then wait-now. EOS is
    ignored so both decode exactly `max_tokens` tokens, and speculation is off, so every step of the
    timelines is one token's decode step."""
    params = {"temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    out = []
    for collectives, _, _ in MODES:
        body, chat = request_body(mode, code, instruction, params, None)
        out.append((collectives, {**body, "laneplay": {"collectives": collectives, "timeline": True,
                                                        "speculative": "off"}}, chat))
    return out


@dataclass
class Run:
    """One mode's run: its meter, its text, and the engine's final `laneplay` record (with the timeline)."""
    collectives: str
    meter: MeterData = field(default_factory=lambda: MeterData(state="idle"))
    text: str = ""
    timing: dict | None = None

    @property
    def timeline(self) -> dict | None:
        return (self.timing or {}).get("timeline")


# ---- the numbers --------------------------------------------------------------------------------------

def per_token(rank: dict) -> dict:
    """A rank's timeline totals per decode step (ms): step, compute, exposed, waited, blocking; issued count."""
    n = rank.get("decode_steps") or 0
    if not n:
        return {}
    return {"step_ms": rank["step"]["ms"] / n, "compute_ms": (rank.get("compute_ms") or 0) / n,
            "exposed_ms": rank["exposed"]["ms"] / n, "waited_ms": rank["wait"]["ms"] / n,
            "blocking_ms": rank["blocking"]["ms"] / n, "issued": rank["issue"]["count"] / n}


def exposed_comm_ms(timeline: dict | None) -> float | None:
    """Communication a mode left exposed, per token, averaged over ranks: the waits on delayed collectives
    plus the "wait now" waits (the blocking collectives are the same in both modes and not counted)."""
    ranks = [per_token(r) for r in (timeline or {}).get("ranks") or []]
    ranks = [r for r in ranks if r]
    if not ranks:
        return None
    return sum(r["exposed_ms"] + r["waited_ms"] for r in ranks) / len(ranks)


def hidden_share(delayed: dict | None, wait_now: dict | None) -> float | None:
    """1 - delayed's exposed communication / wait-now's: the share of communication the delay hid."""
    d, w = exposed_comm_ms(delayed), exposed_comm_ms(wait_now)
    if d is None or not w:
        return None
    return 1 - d / w


# ---- the timeline (inline SVG) -----------------------------------------------------------------------

def _segments(cols: dict, i: int) -> list[tuple[str, float]]:
    issue = cols["issue_ms"][i]
    return [("compute", max(cols["compute_ms"][i] - issue, 0.0)), ("issued", issue), ("waited", cols["waited_ms"][i]),
            ("exposed", cols["exposed_ms"][i]), ("blocking", cols["blocking_ms"][i])]


def timeline_svg(runs: list[Run]) -> str:
    """One row per mode and rank; each decode step kept by the engine (its last 64) is a run of coloured
    segments in proportion to its time, on one time axis for every row; hovering a step gives its numbers."""
    rows = [(run, rank) for run in runs for rank in ((run.timeline or {}).get("ranks") or [])]
    if not rows:
        return ('<div id="dtp-timeline" class="lp-dtp-empty" data-rows="0">The per-rank timeline shows here after '
                'an A/B.</div>')
    label_w, bar_w, right_w, row_h, gap, top = 130, 780, 90, 20, 8, 34
    total = max(sum(rank["steps"]["ms"]) for _, rank in rows) or 1.0
    scale = bar_w / total
    width, height = label_w + bar_w + right_w, top + len(rows) * (row_h + gap) + 18
    out = [f'<svg id="dtp-timeline" class="lp-dtp-timeline" data-rows="{len(rows)}" viewBox="0 0 {width} {height}" '
           f'width="100%" role="img" aria-label="per-rank decode steps, delayed and wait-now" '
           f'xmlns="http://www.w3.org/2000/svg">']
    x = label_w
    for kind, color in COLORS.items():  # the legend
        out.append(f'<rect x="{x}" y="6" width="11" height="11" rx="2" fill="{color}"/>'
                   f'<text x="{x + 15}" y="15.5" class="lp-dtp-legend">{LEGEND[kind]}</text>')
        x += 26 + 6.2 * len(LEGEND[kind])
    labels = dict((c, label) for c, label, _ in MODES)
    short = {"delayed": "delayed", "wait_now": "wait now"}
    for j, (run, rank) in enumerate(rows):
        y = top + j * (row_h + gap)
        cols, n = rank["steps"], len(rank["steps"]["ms"])
        ms = sum(cols["ms"])
        out.append(f'<g class="lp-dtp-row" data-mode="{_esc(run.collectives)}" data-rank="{rank["rank"]}" '
                   f'data-steps="{n}" data-ms="{ms:.3f}">')
        out.append(f'<text x="{label_w - 8}" y="{y + 14}" text-anchor="end" class="lp-dtp-label">'
                   f'{_esc(short.get(run.collectives, run.collectives))} · rank {rank["rank"]}</text>')
        x = float(label_w)
        for i in range(n):
            step = rank["first_step"] + i + 1
            segs = _segments(cols, i)
            tip = (f"{labels.get(run.collectives)} · rank {rank['rank']} · decode step {step}: "
                   f"{cols['ms'][i]:.2f} ms — compute {cols['compute_ms'][i]:.2f} ms, "
                   f"{cols['issued'][i]} collectives issued ({cols['issue_ms'][i]:.2f} ms), "
                   f"waited {cols['waited_ms'][i]:.2f} ms, exposed {cols['exposed_ms'][i]:.2f} ms, "
                   f"blocking {cols['blocking_ms'][i]:.2f} ms")
            out.append(f'<g class="lp-dtp-step" data-step="{step}"><title>{_esc(tip)}</title>')
            sx = x
            for kind, v in segs:
                w = v * scale
                if w > 0.05:
                    out.append(f'<rect x="{sx:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{COLORS[kind]}" '
                               f'data-kind="{kind}"/>')
                sx += w
            x += cols["ms"][i] * scale
            out.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{y}" y2="{y + row_h}" class="lp-dtp-sep"/></g>')
        out.append(f'<text x="{x + 6:.2f}" y="{y + 14}" class="lp-dtp-total">{ms:.1f} ms</text></g>')
    first = rows[0][1]
    out.append(f'<text x="{label_w}" y="{height - 4}" class="lp-dtp-axis">decode steps {first["first_step"] + 1}–'
               f'{first["decode_steps"]} of each run, left to right on one time axis (hover a step for its '
               f'numbers)</text></svg>')
    return "".join(out)


# ---- the table ----------------------------------------------------------------------------------------

def table_html(runs: list[Run]) -> str:
    """Per mode: ms/token and tokens/s (the engine's timing), and per rank the per-token exposed, waited and
    blocking ms from its timeline; under it the share of communication hidden by the delay."""
    by_mode = {r.collectives: r for r in runs}
    world = max((len((r.timeline or {}).get("ranks") or []) for r in runs), default=0)
    if not world:
        return ('<table id="dtp-table" class="lp-dtp-table" data-modes="0"><tr><td class="lp-muted">'
                'Press A/B to measure both modes.</td></tr></table>')
    ms = {m: (by_mode[m].timing or {}).get("ms_per_token") if m in by_mode else None for m, _, _ in MODES}
    share = hidden_share(*(by_mode[m].timeline if m in by_mode else None for m, _, _ in MODES))
    attrs = {"data-modes": str(len(runs)), "data-world-size": str(world),
             "data-ms-delayed": _f(ms["delayed"], ".3f"), "data-ms-wait": _f(ms["wait_now"], ".3f"),
             "data-hidden-share": _f(share, ".4f")}
    head = "".join(f'<th colspan="3">rank {r} · ms per token</th>' for r in range(world))
    sub = "".join('<th title="wait-now waits">exposed</th><th title="waits on delayed collectives">waited</th>'
                  '<th title="early layers, final aggregation, token gather">blocking</th>' for _ in range(world))
    body = []
    for m, label, _ in MODES:
        run = by_mode.get(m)
        if run is None:
            continue
        t = run.timing or {}
        cells = []
        for rank in (run.timeline or {}).get("ranks") or []:
            p = per_token(rank)
            cells += [f'<td data-rank="{rank["rank"]}" data-kind="{k}">{_f(p.get(k + "_ms"), ".2f")}</td>'
                      for k in ("exposed", "waited", "blocking")]
        body.append(f'<tr data-mode="{m}" data-ms-per-token="{_f(t.get("ms_per_token"), ".3f")}" '
                    f'data-tps="{_f(t.get("decode_tokens_per_second"), ".2f")}" '
                    f'data-exposed-comm-ms="{_f(exposed_comm_ms(run.timeline), ".3f")}">'
                    f'<th>{_esc(label)}</th><td>{_f(t.get("ms_per_token"), ".2f") or "–"}</td>'
                    f'<td>{_f(t.get("decode_tokens_per_second"), ".1f") or "–"}</td>{"".join(cells)}</tr>')
    a = " ".join(f'{k}="{_esc(v)}"' for k, v in attrs.items())
    wait_now = by_mode["wait_now"].timeline if "wait_now" in by_mode else None
    if share is None and "delayed" in by_mode and wait_now and exposed_comm_ms(wait_now) == 0:
        summary = ("Both modes ran, and neither waited on a delayed sum: every collective of this model blocks "
                   "where it is issued (a checkpoint of another architecture, such as the embedded Llama-style "
                   "default, runs standard tensor parallelism), so the delay has nothing to hide here. A "
                   "Laneformer checkpoint shows the difference.")
    elif share is None:
        summary = "Run both modes to see how much of the communication the delay hides."
    else:
        speed = (f" Wait-now takes {ms['wait_now'] / ms['delayed']:.2f}× delayed's time per token."
                 if ms["delayed"] and ms["wait_now"] else "")
        summary = (f"Communication hidden by the delay: <b>{max(share, 0.0):.0%}</b> (1 − delayed's exposed waits / "
                   f"wait-now's, per token, mean of the ranks).{speed}")
    return (f'<div class="lp-dtp-table-wrap"><table id="dtp-table" class="lp-dtp-table" {a}><thead>'
            f'<tr><th rowspan="2">collectives</th><th rowspan="2">ms/token</th><th rowspan="2">tokens/s</th>{head}</tr>'
            f'<tr>{sub}</tr></thead><tbody>{"".join(body)}</tbody></table>'
            f'<div class="lp-dtp-summary">{summary}</div></div>')


# ---- the prediction -----------------------------------------------------------------------------------

def prediction(raw_config: dict | None, model_name: str | None) -> dict:
    """The performance model for 8×H200: for the served model (its shapes from the engine's /health
    `model_config`) when it splits over 8 GPUs, else for Laneformer 2B. {"available": False, "why"}
    without the model."""
    try:
        from laneplay.perfmodel import engine_config, node_preset, predict
    except ImportError as e:
        return {"available": False, "why": f"performance model not available ({e})"}
    node = node_preset(NODE)
    cfg, why = engine_config(raw_config), ""
    if cfg is not None:
        try:
            p = predict(cfg, node)
            return {"available": True, "for": "engine", "model": model_name or cfg.name or "this model", "p": p}
        except ValueError as e:  # e.g. PerfModelError: the model does not split over 8 GPUs
            why = str(e)
    else:
        why = "the engine did not say its model's shapes"
    p = predict(None, node)
    return {"available": True, "for": "laneformer-2b", "model": "Laneformer 2B", "p": p, "why": why,
            "engine_model": model_name}


def prediction_html(pred: dict) -> str:
    if not pred.get("available"):
        return (f'<div id="dtp-prediction" class="lp-dtp-prediction" data-available="0">'
                f'{_esc(pred.get("why") or "performance model not available")}</div>')
    p = pred["p"]
    attrs = {"data-available": "1", "data-for": pred["for"], "data-model": pred["model"], "data-node": NODE,
             "data-tps-dtp": f"{p.tokens_per_s_dtp:.1f}", "data-tps-tp": f"{p.tokens_per_s_tp:.1f}",
             "data-hidden-share": f"{p.hidden_share:.4f}"}
    a = " ".join(f'{k}="{_esc(v)}"' for k, v in attrs.items())
    who = "this model" if pred["for"] == "engine" else "Laneformer 2B"
    line = (f"On 8×H200 {who} would decode at ≈ <b>{p.tokens_per_s_dtp:,.0f} tokens/s with DTP</b> "
            f"({p.tokens_per_s_tp:,.0f} with standard TP); DTP hides <b>{p.hidden_share:.0%}</b> of communication.")
    if pred["for"] == "engine":
        note = f"Estimate for the served model, {_esc(pred['model'])}"
    else:
        engine_model = pred.get("engine_model")
        served = f"the served model ({_esc(engine_model)}) " if engine_model else ""
        note = f"Estimate for Laneformer 2B (its published shapes), not {served or 'the served model'}: {_esc(pred['why'])}"
    return (f'<div id="dtp-prediction" class="lp-dtp-prediction" {a}><div class="lp-dtp-pred-line">{line}</div>'
            f'<div class="lp-muted">{note}, batch 1 at position {p.position}, from the performance model '
            f'(<code>laneplay perfmodel</code>): a paper model, not a measurement.</div></div>')


# ---- the tab ------------------------------------------------------------------------------------------

def _idle_meters(ctx: AppContext) -> list[str]:
    info = ctx.engine.info or {}
    state = "idle" if ctx.engine.ready else "loading"
    return [render(MeterData(state=state, device=info.get("device"), dtype=info.get("dtype"), world_size=info.get("world_size"),
                             note=label), elem_id, compact=True, resting=True) for _, label, elem_id in MODES]


def _finish(run: Run, g: Generation) -> None:
    """A mode's run as it ended: its meter, text and the engine's record (with the timeline)."""
    g.finish()
    col = g.columns[0]
    run.text, run.timing, run.meter = col.text, g.timing, col.meter
    run.meter.note = f"{LABELS[run.collectives]} · {run.meter.note}"


class DTPView:
    """The tab's handlers: A/B (both modes, one after the other) and the refresh on selecting the tab."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def frame(self, runs: list[Run], problem: str = "", done: bool = False, fresh: bool = False):
        """One page update: both meters, the error line, and (fresh: empty; at the end: this A/B's) the
        timeline and table; the button is off while an A/B runs."""
        ms = [render(r.meter, elem_id, compact=True) for r, (_, _, elem_id) in zip(runs, MODES)]
        end = bool(done or problem)
        return (*ms, playground.error_html(problem, "dtp-error"),
                timeline_svg(runs) if end or fresh else gr.update(), table_html(runs) if end or fresh else gr.update(),
                gr.update(interactive=availability(self.ctx)[0] is not False) if end else gr.update(interactive=False))

    async def run_ab(self, code_text, instruction_text, mode_value, mt, request: gr.Request):
        ctx = self.ctx
        runs = [Run(c, meter=MeterData(state="idle", note=label)) for c, label, _ in MODES]
        try:
            code_text, instruction_text = check_texts(code_text, instruction_text, mode_value)
            n = sampling(0.0, 1.0, 0, mt, None, None, ctx.engine.info)["max_tokens"]
            if n > MAX_AB_TOKENS:
                raise InputError(f"Max tokens must be at most {MAX_AB_TOKENS} for an A/B (got {n}).")
            playground.admit_generation(ctx, request)  # a cookie, and within the quota (the A/B counts once)
            async for note in engine_ready(ctx.engine):  # a loading engine: wait, saying so
                for r in runs:
                    r.meter.state, r.meter.note = "loading", note
                yield self.frame(runs)
        except (InputError, Limited, EngineError) as e:
            yield self.frame(runs, str(e))
            return
        ok, message = availability(ctx)
        if not ok:
            yield self.frame(runs, message)
            return
        for r in runs:
            r.meter = MeterData(state="queued", note=r.meter.note)
        yield self.frame(runs, fresh=True)
        for r, (collectives, body, chat) in zip(runs, ab_requests(mode_value, code_text, instruction_text, n)):
            g = Generation.of(1)
            async for _ in g.run(ctx, [(None, body, chat)]):
                r.meter = g.columns[0].meter
                yield self.frame(runs)
            _finish(r, g)
            if g.failure is not None:
                yield self.frame(runs, g.failure)
                return
            if r.timeline is None:
                yield self.frame(runs, "The engine sent no timeline: it is not a Laneplay DTP engine of this version.")
                return
            yield self.frame(runs)
        yield self.frame(runs, done=True)

    async def refresh(self):
        """On selecting the tab: what the engine allows, the button, the prediction, resting meters."""
        ctx = self.ctx
        ok, _ = availability(ctx)
        raw, name = None, (ctx.engine.info or {}).get("model")
        if ctx.engine.ready and (ctx.engine.info or {}).get("laneplay", True):
            try:
                raw = (await ctx.client().health()).get("model_config")
            except Exception:  # noqa: BLE001 - the prediction then falls back to Laneformer 2B
                raw = None
        if ctx.engine.ready:
            prediction_box = prediction_html(await asyncio.to_thread(prediction, raw, name))
        else:
            prediction_box = gr.update()
        return status_html(ctx), gr.update(interactive=ok is not False), prediction_box


def build(ctx: AppContext, pg: dict) -> dict:
    """The tab's components and events. `pg`: the Playground's components (its editor, instruction and mode
    are the prompt). Returns what web.py wires to the tab's select."""
    tab = DTPView(ctx)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            status = gr.HTML(status_html(ctx), elem_id="dtp-status-box")
            with gr.Row():
                ab = gr.Button("A/B: delayed vs wait-now", variant="primary", elem_id="dtp-ab", min_width=200,
                               scale=2)
                max_tokens = gr.Number(DEFAULT_MAX_TOKENS, label="Max tokens (greedy)", precision=0,
                                       elem_id="dtp-max-tokens", min_width=120, scale=1, interactive=True)
        with gr.Column(scale=2, min_width=320):
            pred = gr.HTML(prediction_html({"available": False, "why": "The prediction shows when the engine is "
                                                                     "ready."}), elem_id="dtp-prediction-box")
    error = gr.HTML(playground.error_html("", "dtp-error"), elem_id="dtp-error-box")
    with gr.Row(equal_height=False):
        meters = [gr.HTML(m, elem_id=f"{elem_id}-box") for m, (_, _, elem_id) in zip(_idle_meters(ctx), MODES)]
    timeline = gr.HTML(timeline_svg([]), elem_id="dtp-timeline-box")
    table = gr.HTML(table_html([]), elem_id="dtp-table-box")

    ab.click(tab.run_ab, [pg["code"], pg["instruction"], pg["mode"], max_tokens],
             [*meters, error, timeline, table, ab], concurrency_limit=None, api_name="dtp_ab",
             show_progress="hidden", trigger_mode="once")
    return {"refresh": tab.refresh, "refresh_outputs": [status, ab, pred], "ab": ab}
