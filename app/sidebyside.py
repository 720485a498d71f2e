"""The Side by side tab: one prompt, 2-4 columns with their own sampling settings, decoded as ONE batch.

The prompt is the Playground's (editor, instruction, mode). Generate sends one request with the engine's
`samples` extension, one entry per column (temperature, top-p, top-k, seed): the columns share one
prefill and decode together, and each streamed choice goes to its column by its `index`. A column may
put prompt-lookup speculation on (its checkbox); the engine never speculates a request of several
samples, so a run with such a column sends one request per column instead, each with its own
speculation (`with_column_speculation`: "lookup" for a greedy column, which drafts even beside the other
columns, "auto" for a sampled one, "off"; the engine still decodes them together, step by step). A server without the extension (no `laneplay` field) gets one
concurrent plain request per column. Every column has the Playground's meter (the same data-* attributes,
the speculation counts included), "Use this" (its code into the editor) and "Run tests" (its code against
the user's assert-style tests, in the sandbox). The aggregate line sets the run's tokens/s over all
columns against one column alone, at the batch-1 ms/token this page measured last (its last Playground
generation: one sample alone on the engine; never another page's); it says whether the run was one
batch request (the engine's timing) or one request per column (timed here, from the streams).
A run is stored in the page's session as one generation batch of kind "side-by-side".
"""
from __future__ import annotations

import ast
import asyncio
import html
import re
from contextlib import aclosing
from dataclasses import dataclass

import gradio as gr

from laneplay.app import playground, tokenview
from laneplay.app.checks import SandboxMissing, check_code, sandbox_status
from laneplay.app.context import AppContext, InputError, check_texts, request_body, sampling
from laneplay.app.meter import MeterData, of_stored, render
from laneplay.app.quota import Limited
from laneplay.app.stream import Column, Generation, Pages, Ticket
from laneplay.evals.problems import Problem, ProblemError, user_problem
from laneplay.evals.prompting import extract_code, extract_completion
from laneplay.storage import NotFound, ValidationError

MAX_COLUMNS = 4
COLUMN_CHOICES = ["2", "3", "4"]
DEFAULT_COLUMNS = "3"
# preset -> (temperature, top_p, top_k); a preset also gives the column back its own seed
PRESETS = {"greedy": (0.0, 1.0, 0), "T=0.2": (0.2, 0.95, 0), "T=0.8": (0.8, 0.95, 50), "T=1.2": (1.2, 0.95, 50)}
DEFAULT_PRESETS = ("greedy", "T=0.2", "T=0.8", "T=1.2")
DEFAULT_SEEDS = (0, 1, 2, 3)
DEFAULT_MAX_TOKENS = 128
EXAMPLE_TESTS = ('assert is_palindrome("A man, a plan, a canal: Panama")\n'
                 'assert not is_palindrome("abc")\n')
PREVIEW_CHARS, PREVIEW_LINES = 600, 8
TEST_TIMEOUT_S = 10.0
_DEF = re.compile(r"^(?:async\s+)?def\s+([A-Za-z_]\w*)\s*\(", re.M)


# ---- pure helpers ---------------------------------------------------------------------------------------

def preset(name: str, column: int) -> dict:
    """A preset's settings for one column: temperature, top_p, top_k, and the column's own seed."""
    if name not in PRESETS:
        raise InputError(f"Unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    temperature, top_p, top_k = PRESETS[name]
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": DEFAULT_SEEDS[column]}


def column_count(value) -> int:
    if str(value) not in COLUMN_CHOICES:
        raise InputError(f"Choose 2, 3 or 4 columns (got {value!r}).")
    return int(value)


def settings(n: int, temps, top_ps, top_ks, seeds, max_tokens, stop_text,
             info: dict | None = None) -> tuple[dict, list[dict]]:
    """Checked settings: the shared ones (max_tokens, stop) and, per shown column, temperature, top_p,
    top_k and seed (left out when empty: the engine then uses the column's index)."""
    shared = sampling(0.0, 1.0, 0, max_tokens, None, stop_text, info)
    columns = []
    for i in range(n):
        try:
            p = sampling(temps[i], top_ps[i], top_ks[i], 1, seeds[i], None)
        except InputError as e:
            raise InputError(f"Column {i + 1}: {e}") from None
        columns.append({k: p[k] for k in ("temperature", "top_p", "top_k", "seed") if k in p})
    return {"max_tokens": shared["max_tokens"], "stop": shared["stop"]}, columns


def batch_request(mode: str, code: str, instruction: str, shared: dict, columns: list[dict]) -> tuple[dict, bool]:
    """ONE request for all columns: the `samples` extension, one entry per column, in column order."""
    body, chat = request_body(mode, code, instruction, shared, None)
    return {**body, "samples": [dict(c) for c in columns]}, chat


def column_requests(mode: str, code: str, instruction: str, shared: dict,
                    columns: list[dict]) -> list[tuple[dict, bool]]:
    """For servers without `samples`: one ordinary request per column (top_k 0, "off", is left out)."""
    return [request_body(mode, code, instruction, {**shared, **{k: x for k, x in c.items()
                                                                if not (k == "top_k" and x == 0)}}, None)
            for c in columns]


def engine_requests(ours: bool, mode: str, code: str, instruction: str, shared: dict, columns: list[dict],
                    speculative: list[bool] | None = None) -> list[tuple[int | None, dict, bool]]:
    """What Generate sends, as (column, body, chat?). `ours`: the server has our extensions (`samples`,
    `laneplay`); `speculative`: each column's speculation checkbox. Ours and no column speculating: the one
    batch request (column None). Ours and a column speculating: one request per column, each saying
    its own speculation (`with_column_speculation`; a request of several samples never speculates). Not ours: one plain request per
    column (its speculation is the server's business)."""
    if not ours:
        return [(i, body, chat) for i, (body, chat) in
                enumerate(column_requests(mode, code, instruction, shared, columns))]
    if not per_column(speculative):
        return [(None, *batch_request(mode, code, instruction, shared, columns))]
    return [(i, with_column_speculation(body, bool(speculative[i]) if i < len(speculative) else False), chat)
            for i, (body, chat) in enumerate(column_requests(mode, code, instruction, shared, columns))]


def with_column_speculation(body: dict, on: bool) -> dict:
    """A column's speculation: "lookup" for a greedy column (it drafts even while the other columns share
    the engine's steps, where "auto" drafts only in steps where every column drafts; greedy keeps its tokens
    either way), "auto" for
    a sampled one (which then runs plain: "auto" speculates greedy requests only), or "off"."""
    greedy = float(body.get("temperature", 1.0)) < 1e-5 or body.get("top_k") == 1  # as the engine decides
    mode = ("lookup" if greedy else "auto") if on else "off"
    return {**body, "laneplay": {**body.get("laneplay", {}), "speculative": mode}}


def per_column(speculative: list[bool] | None) -> bool:
    """Whether a run goes as one request per column on our engine: some column speculates."""
    return any(bool(x) for x in speculative or ())


def entry_point_of(prompt: str, tests: str, answer: str, given: str | None = "") -> str | None:
    """The function the tests call: the one named by the user, else the prompt's last `def`, else a
    function the tests call that the answer defines, else the answer's first `def` (None: no idea)."""
    if given and given.strip():
        return given.strip()
    if defs := _DEF.findall(prompt or ""):
        return defs[-1]
    answer_defs = _DEF.findall(re.sub(r"^[ \t]+(?=(?:async\s+)?def\s)", "", answer or "", flags=re.M))
    try:
        called = [n.func.id for n in ast.walk(ast.parse(tests or "")) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Name)]
    except SyntaxError:
        called = []
    return next((name for name in called if name in answer_defs), answer_defs[0] if answer_defs else None)


column_code = playground.editor_code  # "Use this" puts what the Playground's "Insert into editor" does


def problem_for(mode: str, code: str, instruction: str, text: str, tests: str,
                 entry_point: str | None) -> tuple[Problem, str, list[str]]:
    """The user's tests as a Problem, and the column's program to run against them (with extraction
    warnings). Raises ProblemError for tests that cannot run."""
    prompt = code if code.strip() else instruction
    entry = entry_point_of(prompt, tests, text, entry_point)
    if entry is None:
        raise ProblemError("cannot tell which function the tests call: type its name in \"Entry point\"")
    problem = user_problem(prompt, tests, entry_point=entry)
    ex = extract_completion(problem, text) if mode == "complete" else extract_code(problem, text)
    return problem, ex.code, ex.warnings


def aggregate(tokens: list[int], decode_s: float | None, single_ms: float | None, requests: str = "batch",
              speculative: list[int] | None = None) -> dict:
    """The run's arithmetic. Decoded tokens are each column's tokens after its first (the first comes
    from the prefill), as in every decode tokens/s here. Batch tokens/s = decoded tokens of all columns /
    decode wall time (first token of any column to the last of any); per column = that / columns. Alone:
    the same tokens one column after another at the batch-1 ms/token `single_ms` (None: unknown, nothing
    is estimated). `requests`: "batch" (one request for all columns: the engine's timing) or "per-column"
    (one request each: timed here, from the streams); `speculative`: the columns with speculation on."""
    n, decoded = len(tokens), sum(max(t - 1, 0) for t in tokens)
    batch_tps = decoded / decode_s if decode_s and decoded else None
    sequential_s = decoded * single_ms / 1000 if single_ms and decoded else None
    return {"columns": n, "requests": requests, "speculative": list(speculative or []),
            "tokens": sum(tokens), "decoded": decoded, "decode_s": decode_s, "batch_tps": batch_tps,
            "column_tps": batch_tps / n if batch_tps else None, "single_ms": single_ms,
            "single_tps": 1000 / single_ms if single_ms else None, "sequential_s": sequential_s,
            "speedup": sequential_s / decode_s if sequential_s and decode_s else None}


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _columns_text(cols: list[int]) -> str:
    names = [str(i + 1) for i in cols]
    return f"column{'s' if len(names) > 1 else ''} " + (", ".join(names[:-1]) + " and " + names[-1]
                                                         if len(names) > 1 else names[0])


# Why the run's rate per column reads lower than the columns' own meters: it spreads the run's whole decode time
# over the columns, while a meter times its column from its own first token to its own last.
PER_COLUMN = " (the run's decode time shared by the columns; each meter times its own column)"


def aggregate_html(agg: dict | None, single_ms: float | None, state: str = "idle") -> str:
    """The aggregate line `#sbs-aggregate`; its data-* attributes carry the numbers: `data-requests` says
    what was measured ("batch": one request for all columns, the engine's decode time; "per-column": one
    request per column, the wall time from the first token of any column to the last of any, timed here)."""
    agg = agg or aggregate([], None, single_ms)
    per_col = agg["requests"] == "per-column"
    attrs = {"data-state": state, "data-requests": agg["requests"],
             "data-speculative": ",".join(str(i) for i in agg["speculative"]),
             "data-columns": str(agg["columns"] or ""), "data-tokens": str(agg["tokens"]),
             "data-batch-tps": _f(agg["batch_tps"], ".2f"), "data-column-tps": _f(agg["column_tps"], ".2f"),
             "data-decode-s": _f(agg["decode_s"], ".3f"), "data-single-ms-per-token": _f(agg["single_ms"], ".2f"),
             "data-speedup": _f(agg["speedup"], ".2f")}
    a = " ".join(f'{k}="{html.escape(x)}"' for k, x in attrs.items())
    spec = (f" (speculation on in {_columns_text(agg['speculative'])})" if agg["speculative"] else "")
    what = (f"{agg['columns']} requests, one per column{spec}" if per_col else f"Batch of {agg['columns']}")
    if agg["batch_tps"] is None:
        head = ("<b>One batch for all columns</b> (one request per column when a column speculates). Generate "
                "decodes the columns together; their tokens/s shows here."
                if state == "idle" else f"<b>{what}</b> · measuring…")
    elif per_col:
        head = (f"<b>{what}: {agg['batch_tps']:.1f} tokens/s</b> over all columns (the engine steps the requests "
                f"together; a speculating column may take several tokens a step) · {agg['column_tps']:.1f} "
                f"tokens/s per column{PER_COLUMN} · {agg['decoded']} tokens decoded in {agg['decode_s']:.2f} s, "
                f"timed here from the first token of any column to the last of any")
    else:
        head = (f"<b>{what}: {agg['batch_tps']:.1f} tokens/s</b> over all columns · "
                f"{agg['column_tps']:.1f} tokens/s per column{PER_COLUMN} · {agg['decoded']} tokens decoded in "
                f"{agg['decode_s']:.2f} s")
    if agg["single_ms"] is None:
        alone = "One column alone: run one Playground generation in this page for a batch-1 reference."
    elif agg["speedup"] is None:
        alone = (f"One column alone decodes at {agg['single_tps']:.1f} tokens/s ({agg['single_ms']:.1f} ms/token, "
                 f"this page's last Playground generation).")
    else:
        alone = (f"One column alone: {agg['single_tps']:.1f} tokens/s ({agg['single_ms']:.1f} ms/token, this page's "
                 f"last Playground generation); these tokens one column after another ≈ {agg['sequential_s']:.2f} s, "
                 f"{agg['speedup']:.1f}× {'this run' if per_col else 'the batch'}'s time.")
    return (f'<div id="sbs-aggregate" class="lp-aggregate" {a}><span>{head}</span>'
            f'<span class="lp-alone">{alone}</span></div>')


def prompt_preview(code: str | None, instruction: str | None, mode: str | None) -> str:
    """What Generate sends, shortened: the chat message, or the code to complete."""
    body, chat = request_body(mode or "chat", code or "", instruction or "", {}, None)
    text = body["messages"][0]["content"] if chat else body["prompt"]
    lines = text.splitlines()
    short = "\n".join(lines[:PREVIEW_LINES])[:PREVIEW_CHARS]
    short += "\n…" if short != text.rstrip("\n") else ""
    what = "Chat message" if chat else "Code to complete"
    return (f'<div id="sbs-prompt" class="lp-sbs-prompt" data-mode="{"chat" if chat else "complete"}">'
            f'<div class="lp-sbs-label">{what} · from the Playground tab (edit it there)</div>'
            f'<pre>{html.escape(short) or "(empty: type an instruction or code in the Playground tab)"}</pre></div>')


def sandbox_html(ok: bool, why: str) -> str:
    if ok:
        return ('<div id="sbs-sandbox" class="lp-muted" data-available="1">Tests run in the sandbox: no network, '
                'read-only system, time and memory limits; one program per core.</div>')
    return (f'<div id="sbs-sandbox" class="lp-error" data-available="0" role="alert">The sandbox is unavailable, so '
            f'no generated code runs here: {html.escape(why)}</div>')


def result_html(i: int, status: str = "", message: str = "", detail: str = "") -> str:
    """`#sbs-result-<i>`: data-status is pass | fail | error | timeout | memory once tests ran; running,
    invalid (bad tests or no code: nothing ran) or unavailable (no sandbox) otherwise; "" before."""
    pre = f"<pre>{html.escape(detail)}</pre>" if detail else ""
    label = f'<span class="lp-status">{html.escape(status)}</span> ' if status in (
        "pass", "fail", "error", "timeout", "memory") else ""
    return (f'<div id="sbs-result-{i}" class="lp-result" data-status="{html.escape(status)}">{label}'
            f'{html.escape(message)}{pre}</div>')


def asked_html(g: dict) -> str:
    """What an output was asked, where that is not what the page shows above it: a snapshot keeps a
    generation's mode, instruction and code only where they differ from its session's (share.snapshot)."""
    esc = html.escape
    parts = []
    if g.get("mode"):
        parts.append(f"<p class='lp-muted'>mode {esc(g['mode'])}</p>")
    if g.get("instruction") is not None:
        parts.append(f"<h4>Instruction</h4><pre class='lp-text'>{esc(g['instruction'])}</pre>")
    if g.get("code") is not None:
        parts.append(f"<h4>Code</h4><pre class='lp-code'>{esc(g['code'])}</pre>")
    if not parts:
        return ""
    return (f"<details class='lp-asked'><summary>This output answered an earlier request (not the one "
            f"above)</summary>{''.join(parts)}</details>")


def share_html(gens: list[dict]) -> str:
    """A stored side-by-side batch for the read-only share page: one column per generation with its
    settings, its meter (compact), its text and its test status."""
    cols = []
    for g in gens:
        i, b = g["sample_index"], g["batch"]
        meter = render(of_stored(g), elem_id=f"sbs-b{b}-meter-{i}", compact=True)
        status = g.get("test_status")
        test = (f"<div class='lp-result' data-status='{html.escape(status)}'><span class='lp-status'>"
                f"{html.escape(status)}</span> tests"
                + (f"<pre>{html.escape(g['test_error'])}</pre>" if g.get("test_error") else "") + "</div>"
                if status else "<div class='lp-result lp-muted' data-status=''>not tested</div>")
        spec = "" if g.get("speculative") is None else f" data-speculative='{int(bool(g['speculative']))}'"
        cols.append(f"<div class='lp-sbs-share-col' data-column='{i}'{spec}><h4>Column {i + 1}</h4>"
                    f"<p class='lp-muted'>{html.escape(describe(g))}</p>{meter}"
                    f"<pre class='lp-code'>{html.escape(g['text'])}</pre>{test}</div>")
    how = "one request per column" if any(g.get("speculative") for g in gens) else "in one batch"
    return (f"<section class='lp-gen lp-sbs-share' data-batch='{gens[0]['batch']}'><h3>Side by side · "
            f"{len(gens)} columns {how}</h3>{asked_html(gens[0])}<div class='lp-sbs-grid' style='--cols:{len(gens)}'>"
            f"{''.join(cols)}</div></section>")


def describe(g: dict) -> str:
    t = g.get("temperature")
    head = "greedy" if t is not None and t < 1e-5 else f"T={t:g}" if t is not None else "T=–"
    spec = "" if g.get("speculative") is None else f" · speculation {'on' if g['speculative'] else 'off'}"
    return (f"{head} · top-p {g.get('top_p') if g.get('top_p') is not None else '–'} · "
            f"top-k {g.get('top_k') or 'off'} · seed {g.get('seed') if g.get('seed') is not None else '–'}{spec}")


# ---- one run --------------------------------------------------------------------------------------------

def reference_ms(last: dict | None) -> float | None:
    """The batch-1 ms/token this page measured last: its last Playground generation (one sample alone on
    the engine), if it ran to the end or to Stop. Never another page's: each page keeps its own."""
    last = last or {}
    if last.get("batch_1") and last.get("state") in ("done", "stopped") and (last.get("tokens") or 0) > 1:
        return last.get("ms_per_token") or None
    return None


def _record(i: int, c: Column) -> dict:
    return {**c.stored(i), "kind": "side-by-side", "temperature": c.settings["temperature"],
            "top_p": c.settings["top_p"], "top_k": c.settings["top_k"], "seed": c.settings.get("seed"),
            "speculative": c.settings.get("speculative")}


@dataclass
class Frame:
    """One update of the tab's outputs (in the order `build` wires them)."""
    g: Generation
    n: int
    problem: str = ""
    agg: object = None
    sid: object = None
    run: object = None
    fresh: bool = False  # a new run: the test results of the last one are cleared

    def row(self) -> tuple:
        cols, shown = self.g.columns, range(MAX_COLUMNS)
        texts = [cols[i].text if i < self.n else gr.update() for i in shown]
        meters = [render(cols[i].meter, f"sbs-meter-{i}", compact=True) if i < self.n else gr.update() for i in shown]
        results = [result_html(i) if self.fresh else gr.update() for i in shown]
        tokens = [tokenview.render(cols[i].tokens, f"sbs-token-view-{i}") if i < self.n else gr.update() for i in shown]
        return (*texts, *meters, playground.error_html(self.problem, "sbs-error"),
                self.agg if self.agg is not None else gr.update(), self.sid,
                self.run if self.run is not None else gr.update(), *results, *tokens)


class SideBySide:
    """The tab's handlers: Generate and Stop per page (`stream.Pages`), "Use this", "Run tests"."""

    def __init__(self, ctx: AppContext):
        self.ctx, self.pages = ctx, Pages()

    async def generate(self, request: gr.Request, code_text, instruction_text, mode_value, n_value, mt, stop_text,
                       *rest):
        temps, top_ps, top_ks, seeds, specs = rest[0:4], rest[4:8], rest[8:12], rest[12:16], rest[16:20]
        sid, last = rest[20], rest[21]
        try:
            n = column_count(n_value)
            code_text, instruction_text = check_texts(code_text, instruction_text, mode_value)
            shared, col_settings = settings(n, temps, top_ps, top_ks, seeds, mt, stop_text, self.ctx.engine.info)
            owner = playground.admit_generation(self.ctx, request)
        except (InputError, Limited) as e:  # a message; nothing sent, nothing stored
            n = column_count(n_value) if str(n_value) in COLUMN_CHOICES else MAX_COLUMNS
            bad = Generation([Column(meter=MeterData(state="error", note="invalid input")) for _ in range(n)])
            yield Frame(bad, n, str(e), sid=sid).row()
            return
        ticket = self.pages.begin(playground.page_key(self.ctx, request))
        runs = {"mode": mode_value, "code": code_text, "instruction": instruction_text, "n": n, "sid": sid,
                "batch": None}
        speculative = [bool(x) for x in specs[:n]]
        try:
            async with aclosing(self._generate(ticket, runs, owner, shared, col_settings, reference_ms(last),
                                               speculative)) as fs:
                async for f in fs:
                    yield f.row()
        finally:
            ticket.end()

    async def _generate(self, ticket: Ticket, runs: dict, owner, shared: dict, col_settings: list[dict], single_ms,
                        speculative: list[bool] | None = None):
        speculative = [bool(speculative and i < len(speculative) and speculative[i]) for i in range(len(col_settings))]
        g = Generation([Column({**s, "speculative": on}) for s, on in zip(col_settings, speculative)])
        n, sid = runs["n"], runs["sid"]
        how = {"requests": "per-column" if per_column(speculative) else "batch",
               "speculative": [i for i, on in enumerate(speculative) if on]}

        def plan(info):  # every column's tokens with their probabilities (its token view)
            ours = info.get("laneplay", True) is not False
            requests = engine_requests(ours, runs["mode"], runs["code"], runs["instruction"], shared, col_settings,
                                       speculative)
            if not ours:  # a plain server: nothing about speculation was asked, so nothing is stored about it
                for c in g.columns:
                    c.settings["speculative"] = None
                how["speculative"] = []
            how["requests"] = "batch" if requests[0][0] is None else "per-column"
            return [(col, playground.with_logprobs(body, chat), chat) for col, body, chat in requests]

        def measure():
            return aggregate([c.meter.tokens for c in g.columns], g.decode_s(), single_ms, **how)

        fresh = True
        async for _ in g.run(self.ctx, plan, ticket.wanted):
            yield Frame(g, n, agg=aggregate_html(measure(), single_ms, "running"), sid=sid, run=runs, fresh=fresh)
            fresh = False
        failure = g.finish()
        final = measure()
        agg_done = aggregate_html(final, single_ms, "error" if failure else "stopped" if g.cancelled else "done")
        problem = failure or ""
        if failure is None and any(c.text for c in g.columns):
            try:
                sid, runs["batch"] = playground.save_batch(self.ctx, sid, owner, runs["code"], runs["instruction"],
                                                           self.ctx.engine.info or {},
                                                           [_record(i, c) for i, c in enumerate(g.columns)], columns=n,
                                                           mode=runs.get("mode", "chat"))
                runs["sid"] = sid
            except ValidationError as e:
                problem = f"The run was not stored: {e}"
        if not ticket.superseded():  # a newer Generate of this page owns the page now
            yield Frame(g, n, problem, agg_done, sid, runs)

    def stop(self, request: gr.Request):
        self.pages.stop(playground.page_key(self.ctx, request))

    def use(self, i: int):
        def use(text, runs, tests_text, entry_text):
            """The column's code into the Playground editor, and the Playground in front."""
            runs = runs or {}
            code = column_code(runs.get("mode", "chat"), runs.get("code", ""), runs.get("instruction", ""), text or "",
                               entry_point_of(runs.get("code", ""), tests_text, text or "", entry_text))
            if not code.strip():
                return gr.update(), gr.update(), playground.error_html(f"Column {i + 1} has no code to use yet.",
                                                                       "sbs-error")
            return code, gr.Tabs(selected="playground"), playground.error_html("", "sbs-error")
        return use

    def test(self, i: int):
        ctx = self.ctx

        async def run_tests(request: gr.Request, text, runs, tests_text, entry_text):
            """The column's code against the tests, in the sandbox; the outcome is stored with the generation."""
            runs = runs or {}
            owner = ctx.owner_of(request)
            if owner is None:
                yield result_html(i, "invalid", "This browser has no valid session cookie; reload the page. "
                                                "Nothing ran.")
                return
            if not (text or "").strip() or i >= runs.get("n", 0):
                yield result_html(i, "invalid", f"Generate first: column {i + 1} has no output to test.")
                return
            try:
                problem, code, warnings = problem_for(runs["mode"], runs["code"], runs["instruction"], text,
                                                       tests_text or "", entry_text)
            except ProblemError as e:
                yield result_html(i, "invalid", f"The tests cannot run: {e}. Nothing ran.")
                return
            if not code.strip():
                yield result_html(i, "invalid", f"No code found in column {i + 1}; nothing ran.")
                return
            try:
                with ctx.quota.sandbox_run(owner, ctx.address_of(request)):
                    yield result_html(i, "running", f"Running {problem.entry_point}() against the tests in the "
                                                    "sandbox…")
                    out = await check_code(problem, code, timeout_s=TEST_TIMEOUT_S)
            except Limited as e:
                yield result_html(i, "invalid", f"{e} Nothing ran.")
                return
            except SandboxMissing as e:
                yield result_html(i, "unavailable", str(e))
                return
            note = f" · {out.seconds:.2f} s" + (f" · {'; '.join(warnings)}" if warnings else "")
            sid, batch = runs.get("sid"), runs.get("batch")
            if sid and batch and ctx.store.owns(sid, owner):
                try:
                    ctx.store.set_generation_test(sid, batch, i, out.status, out.error or None, owner=owner)
                except (NotFound, ValidationError) as e:
                    note += f" · not stored: {e}"
            yield result_html(i, out.status, f"{problem.entry_point}(){note}", out.error)
        return run_tests

    async def refresh(self, code_text, instruction_text, mode_value):
        """On selecting the tab: the prompt as it is now, and whether the sandbox works here."""
        ok, why = await asyncio.to_thread(sandbox_status)
        return prompt_preview(code_text, instruction_text, mode_value), sandbox_html(ok, why)


# ---- the tab --------------------------------------------------------------------------------------------

def _column_ui(i: int) -> dict:
    s = preset(DEFAULT_PRESETS[i], i)
    with gr.Column(visible=i < int(DEFAULT_COLUMNS), min_width=230, elem_classes=["lp-sbs-col"]) as box:
        ui = {"box": box}
        with gr.Row(elem_classes=["lp-sbs-knobs"]):
            ui["preset"] = gr.Dropdown(list(PRESETS), value=DEFAULT_PRESETS[i], label=f"Column {i + 1}",
                                       elem_id=f"sbs-preset-{i}", interactive=True, min_width=96, scale=2)
            ui["temp"] = gr.Number(s["temperature"], label="Temp.", elem_id=f"sbs-temp-{i}", step=0.05,
                                   min_width=50, interactive=True)
            ui["top_p"] = gr.Number(s["top_p"], label="Top-p", elem_id=f"sbs-top-p-{i}", step=0.05, min_width=50,
                                    interactive=True)
            ui["top_k"] = gr.Number(s["top_k"], label="Top-k", elem_id=f"sbs-top-k-{i}", precision=0, min_width=50,
                                    interactive=True)
            ui["seed"] = gr.Number(s["seed"], label="Seed", elem_id=f"sbs-seed-{i}", precision=0, min_width=50,
                                   interactive=True)
        ui["speculative"] = gr.Checkbox(False, label="Speculative decoding (greedy columns only)",
                                        info="Prompt lookup: same tokens, several per step. A sampled column runs "
                                             "plain. Any column on: one request per column.",
                                        elem_id=f"sbs-speculative-{i}", interactive=True)
        ui["meter"] = gr.HTML(render(MeterData(state="loading", note="starting"), f"sbs-meter-{i}", compact=True,
                                     resting=True), elem_id=f"sbs-meter-box-{i}")
        ui["out"] = gr.Code(value="", language="python", label=f"Column {i + 1}", elem_id=f"sbs-col-{i}",
                            interactive=False, lines=10, max_lines=30, wrap_lines=True)
        with gr.Row():
            ui["use"] = gr.Button("Use this", elem_id=f"sbs-use-{i}", size="sm", min_width=80)
            ui["test"] = gr.Button("Run tests", elem_id=f"sbs-test-{i}", size="sm", min_width=80)
        ui["result"] = gr.HTML(result_html(i), elem_id=f"sbs-result-box-{i}")
        ui["tokens"] = gr.HTML(tokenview.render([], f"sbs-token-view-{i}"), elem_id=f"sbs-token-view-box-{i}")
    return ui


def _controls_ui() -> dict:
    ui = {}
    with gr.Row():
        ui["ncols"] = gr.Radio(COLUMN_CHOICES, value=DEFAULT_COLUMNS, label="Columns", elem_id="sbs-columns",
                               interactive=True, min_width=240)  # room for all three choices
        ui["max_tokens"] = gr.Number(DEFAULT_MAX_TOKENS, label="Max tokens", precision=0, elem_id="sbs-max-tokens",
                                     min_width=90, interactive=True)
        ui["stops"] = gr.Textbox("", label="Stop strings", lines=1, max_lines=4, elem_id="sbs-stop-strings",
                                 min_width=120, interactive=True)
    with gr.Row():
        ui["generate"] = gr.Button("Generate", variant="primary", elem_id="sbs-generate", min_width=90)
        ui["stop"] = gr.Button("Stop", variant="stop", elem_id="sbs-stop", min_width=70)
    return ui


def _tests_ui() -> tuple:
    with gr.Accordion("Tests (for \"Run tests\")", open=True):
        with gr.Row(equal_height=False):
            tests = gr.Code(value=EXAMPLE_TESTS, language="python", label="Assert-style tests", elem_id="sbs-tests",
                            interactive=True, lines=4, max_lines=14, scale=3)
            with gr.Column(scale=1, min_width=200):
                entry = gr.Textbox("", label="Entry point (optional)", placeholder="inferred from the code or tests",
                                   elem_id="sbs-entry-point", interactive=True)
                sandbox = gr.HTML('<div id="sbs-sandbox" class="lp-muted"></div>', elem_id="sbs-sandbox-box")
    return tests, entry, sandbox


def build(ctx: AppContext, session_id: gr.State, pg: dict, tabs: gr.Tabs) -> dict:
    """The tab's components and events. `pg`: the Playground's components (its editor, instruction and mode
    are this tab's prompt; "Use this" writes the editor; its last run is this page's batch-1 reference).
    Returns what web.py wires to the tab's select."""
    tab = SideBySide(ctx)
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            preview = gr.HTML(prompt_preview(playground.EXAMPLE_CODE, playground.EXAMPLE_INSTRUCTION, "chat"),
                              elem_id="sbs-prompt-box")
        with gr.Column(scale=2, min_width=320):
            ui = _controls_ui()
    error = gr.HTML(playground.error_html("", "sbs-error"), elem_id="sbs-error-box")
    agg = gr.HTML(aggregate_html(None, None), elem_id="sbs-aggregate-box")
    with gr.Row(equal_height=False, elem_id="sbs-grid"):
        cols = [_column_ui(i) for i in range(MAX_COLUMNS)]
    tests, entry, sandbox = _tests_ui()
    run_state = gr.State({})  # the last run of this page: its prompt, mode, session and batch
    quiet = {"show_progress": "hidden"}
    ui["ncols"].change(lambda n: [gr.update(visible=i < int(n)) for i in range(MAX_COLUMNS)], [ui["ncols"]],
                       [c["box"] for c in cols], **quiet)
    column_inputs = [c[k] for k in ("temp", "top_p", "top_k", "seed", "speculative") for c in cols]  # 4 temps, ...
    ui["generate"].click(tab.generate, [pg["code"], pg["instruction"], pg["mode"], ui["ncols"], ui["max_tokens"],
                                        ui["stops"], *column_inputs, session_id, pg["last"]],
                         [*[c["out"] for c in cols], *[c["meter"] for c in cols], error, agg, session_id, run_state,
                          *[c["result"] for c in cols], *[c["tokens"] for c in cols]],
                         concurrency_limit=None, api_name="side_by_side", trigger_mode="multiple", **quiet)
    ui["stop"].click(tab.stop, None, None, api_name="side_by_side_stop", queue=False, **quiet)
    for i, c in enumerate(cols):
        c["preset"].input(lambda name, i=i: tuple(preset(name, i).values()), [c["preset"]],
                          [c["temp"], c["top_p"], c["top_k"], c["seed"]], **quiet)
        c["use"].click(tab.use(i), [c["out"], run_state, tests, entry], [pg["code"], tabs, error], **quiet)
        c["test"].click(tab.test(i), [c["out"], run_state, tests, entry], [c["result"]], concurrency_limit=None,
                        **quiet)
    return {"refresh": tab.refresh, "refresh_inputs": [pg["code"], pg["instruction"], pg["mode"]],
            "refresh_outputs": [preview, sandbox], "columns": ui["ncols"], "run": run_state}
