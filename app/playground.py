"""The Playground tab: editor + instruction, sampling controls, streamed output, the live meter, share."""
from __future__ import annotations

import html
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, fields

import gradio as gr

from laneplay.app import tokenview
from laneplay.app.context import AppContext, InputError, check_texts, request_body, sampling
from laneplay.app.meter import MeterData, render
from laneplay.app.params import PENALTIES
from laneplay.app.quota import Limited
from laneplay.app.stream import Column, Generation, Pages, Ticket
from laneplay.evals.problems import Problem
from laneplay.evals.prompting import extract_code
from laneplay.storage import NotFound, ValidationError

MODES = [("Complete the code in the editor", "complete"), ("Chat: instruction + code as context", "chat")]
EXAMPLE_CODE = "def is_palindrome(s: str) -> bool:\n"
# Generate's, in order
SAMPLING_INPUTS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stops", *PENALTIES, "show_tokens",
                   "speculative")
STORED_PARAMS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", *PENALTIES)  # the session keeps
EXAMPLE_INSTRUCTION = "Write a Python function is_palindrome(s) that ignores case and non-alphanumeric characters."


def error_html(message: str, elem_id: str = "error") -> str:
    """The visible error line: our own element `#error` (or `elem_id`), empty when there is nothing wrong."""
    if not message:
        return f'<div id="{elem_id}" class="lp-error-none"></div>'
    return f'<div id="{elem_id}" class="lp-error" role="alert">{html.escape(message)}</div>'



def engine_line(ctx: AppContext) -> str:
    e = ctx.engine
    info = e.info or {}
    where = ""
    if e.ready and info.get("device"):
        ws = info.get("world_size")
        where = f" · {info.get('model')} on {info.get('device')}" + (f" × {ws}" if ws else "")
        if not info.get("laneplay", True):
            where += " · no server timing: the meter times the stream here"
    detail = "" if e.ready else f" — {html.escape(e.detail)}"
    return (f'<div class="lp-engine" id="engine-status" data-state="{html.escape(e.state)}" '
            f'data-detail="{html.escape(e.detail)}">engine: '
            f'<b data-state="{html.escape(e.state)}">{html.escape(e.state)}</b>{html.escape(where)}{detail}</div>')


def idle_meter(ctx: AppContext) -> str:
    e = ctx.engine
    info = e.info or {}
    if not e.ready:
        return render(MeterData(state="loading", note=e.detail), resting=True)
    return render(MeterData(state="idle", device=info.get("device"), dtype=info.get("dtype"), world_size=info.get("world_size"),
                            source="server" if info.get("laneplay", True) else "app"), resting=True)


def page_key(ctx: AppContext, request) -> tuple[str | None, str]:
    """Whose page this is: (owner, Gradio session). Stop and supersede go by both, so a request that
    reuses another browser's page id reaches nothing of that browser's."""
    return ctx.owner_of(request), getattr(request, "session_hash", None) or str(id(request))


def admit_generation(ctx: AppContext, request) -> str:
    """The owner of a Generate that may go ahead; InputError (the page's message) for no cookie, Limited
    past the quota."""
    owner = ctx.owner_of(request)
    if owner is None:
        raise InputError("This browser has no valid session cookie; reload the page.")
    ctx.quota.generation(owner, ctx.address_of(request))
    return owner


def session_title(code: str, instruction: str, mode: str = "chat") -> str:
    """A new session's title: the first line of what the model was asked (complete: the editor's code;
    chat: the instruction), else of the other one."""
    asked, other = (code, instruction) if mode == "complete" else (instruction, code)
    first = next((line.strip() for line in (asked + "\n" + other).splitlines() if line.strip()), "")
    return (first[:80] + "…") if len(first) > 80 else (first or "Untitled session")


@dataclass
class View:
    """One update of the Playground's outputs (in the order `build` wires them)."""
    text: object = ""
    meter: object = ""
    error: str = ""
    sid: object = None
    # the meter record of this page's last run; `batch_1`: measured here, one sample alone (Side by side's
    # reference), unlike a record History or a fork put back
    last: dict = field(default_factory=dict)
    tokens: str = field(default_factory=lambda: tokenview.render([]))  # the token view (#token-view)

    def row(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


def view(col: Column, sid, problem: str = "") -> View:
    return View(col.text, render(col.meter), error_html(problem), sid, {**asdict(col.meter), "batch_1": True},
                tokenview.render(col.tokens))


def editor_code(mode: str, code: str, instruction: str, text: str, entry_point: str | None = None) -> str:
    """What an answer puts back in the editor ("Insert into editor", Side by side's "Use this"): in complete
    mode the editor code + the completion as is; in chat mode the answer's code block (the one defining the
    entry point when it is known), without its fence or the prose around it."""
    if mode == "complete":
        return code + text
    problem = Problem("user/0", code.strip() or instruction, entry_point or "", "")
    return extract_code(problem, text).code.strip("\n") + "\n" if text.strip() else ""


def with_logprobs(body: dict, chat: bool) -> dict:
    """The request asks for each token's log-probability and its top alternatives (the token view)."""
    if chat:
        return {**body, "logprobs": True, "top_logprobs": tokenview.TOP_LOGPROBS}
    return {**body, "logprobs": tokenview.TOP_LOGPROBS}


def with_speculation(body: dict, on: bool) -> dict:
    """The request's prompt-lookup speculation: "auto" (the engine drafts where it pays) or "off"."""
    return {**body, "laneplay": {**body.get("laneplay", {}), "speculative": "auto" if on else "off"}}


class Playground:
    """The tab's handlers: Generate and Stop per page (`stream.Pages`), Share."""

    def __init__(self, ctx: AppContext):
        self.ctx, self.pages = ctx, Pages()

    async def generate(self, code_text, instruction_text, mode_value, temp, tp, tk, mt, sd, stop_text, fp, pp, rp,
                       show_tokens, speculative, sid, request: gr.Request):
        try:  # everything is checked first: a bad value is a message, nothing stored, nothing sent
            code_text, instruction_text = check_texts(code_text, instruction_text, mode_value)
            params = sampling(temp, tp, tk, mt, sd, stop_text, self.ctx.engine.info,  # max tokens: its context
                              frequency_penalty=fp, presence_penalty=pp, repetition_penalty=rp)
            owner = admit_generation(self.ctx, request)
        except (InputError, Limited) as e:
            bad = MeterData(state="error", note="limited" if isinstance(e, Limited) else "invalid input")
            yield View("", render(bad), error_html(str(e)), sid, asdict(bad)).row()
            return
        ticket = self.pages.begin(page_key(self.ctx, request))
        try:
            async with aclosing(self._generate(ticket, code_text, instruction_text, mode_value, params, sid,
                                               owner, bool(show_tokens), bool(speculative))) as views:
                async for v in views:
                    yield v.row()
        finally:
            ticket.end()

    async def _generate(self, ticket: Ticket, code_text, instruction_text, mode_value, params, sid, owner,
                        show_tokens: bool = True, speculative: bool = True):
        ctx = self.ctx
        body, chat = request_body(mode_value, code_text, instruction_text, params, None)
        if show_tokens:
            body = with_logprobs(body, chat)
        if (ctx.engine.info or {}).get("laneplay", True) is not False:  # ours: speculation "auto" or "off"
            body = with_speculation(body, speculative)
        g = Generation.of(1)
        col = g.columns[0]
        async for _ in g.run(ctx, [(None, body, chat)], ticket.wanted):
            if not col.finish:  # the finished run shows once, stored: "done" means Share and History have it
                yield view(col, sid)
        failure = g.finish()
        if failure is not None:
            if not ticket.superseded():
                yield view(col, sid, failure)
            return
        problem = ""
        if col.text or not g.cancelled:
            try:
                sid = self._store(sid, owner, code_text, instruction_text, params, col, mode_value)
            except ValidationError as e:
                problem = f"The generation was not stored: {e}"
        if not ticket.superseded():  # superseded: what was made is kept, and the page shows the newer run
            yield view(col, sid, problem)

    def _store(self, sid, owner, code_text, instruction_text, params, col: Column, mode: str) -> str:
        """The generation and the editor state it came from, in the session (created on first use)."""
        record = {**col.stored(0), "seed": params.get("seed"), "temperature": params["temperature"]}
        stored_params = {k: params[k] for k in STORED_PARAMS if k in params}
        info = self.ctx.engine.info or {}
        return save_batch(self.ctx, sid, owner, code_text, instruction_text, info, [record],
                          params=stored_params, mode=mode)[0]

    def stop(self, request: gr.Request):
        """Stop: the running generation of this page ends at once and says `stopped`."""
        self.pages.stop(page_key(self.ctx, request))

    def share(self, sid, request: gr.Request):
        ctx = self.ctx
        owner = ctx.owner_of(request)
        if not sid or not ctx.store.owns(sid, owner):
            return "", error_html("Generate something first: a share link freezes this session as it is now.")
        try:
            token, _ = ctx.store.share_session(sid, owner=owner)
        except (ValidationError, NotFound) as e:
            return "", error_html(str(e))
        base = str(request.request.base_url).rstrip("/")
        url = f"{base}/s/{token}"
        return (f'<div class="lp-share">Read-only link (anyone with it can view this snapshot): '
                f'<a id="share-link" href="{html.escape(url)}" target="_blank" rel="noreferrer">{html.escape(url)}</a> '
                f'<button class="lp-copy" type="button" data-copy="{html.escape(url)}">copy</button>'
                f'</div>'), error_html("")


def _sampling_ui() -> dict:
    """The sampling controls. The slider offers the range that matters for code; what is typed anywhere
    else is checked against the engine's own bounds (`limits`)."""
    ui = {}
    with gr.Accordion("Sampling", open=True):
        with gr.Row():
            ui["temperature"] = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                          elem_id="temperature", interactive=True)
            ui["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="top-p", interactive=True)
        with gr.Row():
            ui["top_k"] = gr.Number(value=0, label="Top-k (0 = off)", precision=0, elem_id="top-k", interactive=True,
                                    min_width=80)
            ui["max_tokens"] = gr.Number(value=256, label="Max tokens", precision=0, elem_id="max-tokens",
                                         interactive=True, min_width=80)
            ui["seed"] = gr.Number(value=0, label="Seed", precision=0, elem_id="seed", interactive=True, min_width=80)
        ui["stops"] = gr.Textbox(value="", label="Stop strings (one per line; \\n for a newline)", lines=1,
                                 max_lines=4, elem_id="stop-strings", interactive=True)
        with gr.Row():  # against loops: OpenAI's penalties over the output, and the multiplicative one over it all
            ui["frequency_penalty"] = gr.Slider(-2.0, 2.0, value=0.0, step=0.05, label="Frequency penalty",
                                                elem_id="frequency-penalty", interactive=True)
            ui["presence_penalty"] = gr.Slider(-2.0, 2.0, value=0.0, step=0.05, label="Presence penalty",
                                               elem_id="presence-penalty", interactive=True)
            ui["repetition_penalty"] = gr.Number(value=1.0, label="Repetition penalty (1 = off)", step=0.05,
                                                 elem_id="repetition-penalty", interactive=True, min_width=80)
        ui["show_tokens"] = gr.Checkbox(value=True, label="Token view: each token's probability and its alternatives",
                                        elem_id="show-tokens", interactive=True)
        ui["speculative"] = gr.Checkbox(value=True, label="Speculative decoding: draft from the prompt (prompt "
                                        "lookup), verify several tokens per step; same tokens", elem_id="speculative",
                                        interactive=True)
    return ui


def build(ctx: AppContext, session_id: gr.State) -> dict:
    """The tab's components and events; returns the components other tabs use."""
    tab = Playground(ctx)
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            code = gr.Code(value=EXAMPLE_CODE, language="python", label="Code", elem_id="code", interactive=True,
                           lines=10, max_lines=22)
            instruction = gr.Textbox(value=EXAMPLE_INSTRUCTION, label="Instruction", elem_id="instruction", lines=2,
                                     max_lines=6, interactive=True)
            mode = gr.Radio(MODES, value="chat", label="Mode", elem_id="mode", interactive=True)
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id="generate", min_width=90)
                stop = gr.Button("Stop", variant="stop", elem_id="stop", min_width=70)
                insert = gr.Button("Insert into editor", elem_id="insert", min_width=140)
                share = gr.Button("Share", elem_id="share", min_width=70)
            knobs = _sampling_ui()
        with gr.Column(scale=6):
            engine_status = gr.HTML(engine_line(ctx), elem_id="engine-box")
            meter = gr.HTML(render(MeterData(state="loading", note="starting"), resting=True), elem_id="meter-box")
            error = gr.HTML(error_html(""), elem_id="error-box")
            output = gr.Code(value="", language="python", label="Output", elem_id="output", interactive=False,
                             lines=16, max_lines=40, wrap_lines=True)  # a long line wraps, indentation kept
            tokens = gr.HTML(tokenview.render([]), elem_id="token-view-box")
            share_box = gr.HTML("", elem_id="share-box")
    last = gr.State({})  # the meter record of this page's last run (Side by side's batch-1 reference)
    generate.click(tab.generate, [code, instruction, mode, *(knobs[k] for k in SAMPLING_INPUTS), session_id],
                   [output, meter, error, session_id, last, tokens], concurrency_limit=None, api_name="generate",
                   show_progress="hidden", trigger_mode="multiple")
    stop.click(tab.stop, None, None, api_name="stop", show_progress="hidden", queue=False)
    insert.click(lambda out, cur, m, ins: editor_code(m, cur, ins, out) if out.strip() else cur,
                 [output, code, mode, instruction], [code], api_name="insert", show_progress="hidden")
    share.click(tab.share, [session_id], [share_box, error], api_name="share", show_progress="hidden")
    # Once a second, the engine's state line (never the meter or the error line: a running request owns
    # those); meter.js follows this line for a resting meter and a lost engine.
    gr.Timer(1.0).tick(lambda: engine_line(ctx), None, [engine_status], concurrency_limit=None,
                       show_progress="hidden")
    return {"code": code, "instruction": instruction, "mode": mode, **knobs, "output": output, "meter": meter,
            "error": error, "share_box": share_box, "last": last, "make_share": tab.share}


def save_batch(ctx, sid, owner, code_text, instruction_text, info, records: list[dict], params: dict | None = None,
               mode: str = "chat", **fields) -> tuple[str, int]:
    """One batch of generations and the editor state it came from, in the session (created on first use,
    when this browser does not own `sid`). `params`: the session's sampling settings (None: kept as they
    are); `fields`: other session fields (e.g. columns). Returns (session id, batch number)."""
    fields = dict(code=code_text, instruction=instruction_text, mode=mode, model=str(info.get("model") or "")[:200],
                  device=str(info.get("device") or "")[:32],
                  world_size=max(1, min(int(info.get("world_size") or 1), 8)), **fields)
    if params is not None:
        fields["params"] = params
    asked = {"mode": mode, "instruction": instruction_text, "code": code_text}  # each output keeps what it answered
    records = [{**r, **asked} for r in records]
    if not sid or not ctx.store.owns(sid, owner):
        sid = ctx.store.create_session(title=session_title(code_text, instruction_text, mode), owner=owner,
                                       **{"params": {}, **fields})
    else:
        ctx.store.update_session(sid, owner=owner, **fields)
    return sid, ctx.store.add_generations(sid, records, owner=owner)
