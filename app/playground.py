"""The Playground tab: editor + instruction, sampling controls, streamed output, the live meter, share."""
from __future__ import annotations

import asyncio
import html
import itertools
import time
from contextlib import aclosing
from dataclasses import asdict

import gradio as gr

from laneplay.app.client import EngineError, StreamTimer
from laneplay.app.context import AppContext, InputError, check_texts, request_body, sampling
from laneplay.app.quota import Limited
from laneplay.app.meter import MeterData, render
from laneplay.storage import NotFound, ValidationError

UPDATE_EVERY_S = 0.1  # at most ten page updates a second while tokens stream
ENGINE_WAIT_S = 600.0  # Generate waits this long for a loading engine before giving up

MODES = [("Complete the code in the editor", "complete"), ("Chat: instruction + code as context", "chat")]
EXAMPLE_CODE = "def is_palindrome(s: str) -> bool:\n"
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


async def stream_to(ctx: AppContext, body: dict, chat: bool, put) -> None:
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


def session_title(code: str, instruction: str) -> str:
    first = (instruction.strip() or code.strip()).splitlines()[0] if (instruction.strip() or code.strip()) else ""
    return (first[:80] + "…") if len(first) > 80 else (first or "Untitled session")


def build(ctx: AppContext, session_id: gr.State) -> dict:
    """The tab's components and events; returns the components other tabs use."""
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
            with gr.Accordion("Sampling", open=True):
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                            elem_id="temperature", interactive=True)
                    top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="top-p",
                                      interactive=True)
                with gr.Row():
                    top_k = gr.Number(value=0, label="Top-k (0 = off)", precision=0, elem_id="top-k",
                                      interactive=True, min_width=80)
                    max_tokens = gr.Number(value=256, label="Max tokens", precision=0, elem_id="max-tokens",
                                           interactive=True, min_width=80)
                    seed = gr.Number(value=0, label="Seed", precision=0, elem_id="seed",
                                     interactive=True, min_width=80)
                stops = gr.Textbox(value="", label="Stop strings (one per line; \\n for a newline)", lines=1,
                                   max_lines=4, elem_id="stop-strings", interactive=True)
        with gr.Column(scale=6):
            engine_status = gr.HTML(engine_line(ctx), elem_id="engine-box")
            meter = gr.HTML(render(MeterData(state="loading", note="starting"), resting=True), elem_id="meter-box")
            error = gr.HTML(error_html(""), elem_id="error-box")
            output = gr.Code(value="", language="python", label="Output", elem_id="output", interactive=False,
                             lines=16, max_lines=40, wrap_lines=True)  # a long line wraps, indentation kept
            share_box = gr.HTML("", elem_id="share-box")
    busy = gr.State(False)
    current: dict = {}  # page (Gradio session) -> id of the one generation that may run there
    generation_ids = itertools.count(1)
    last = gr.State({})  # the last meter record of this page (the Stop button renders it as stopped)

    async def run(code_text, instruction_text, mode_value, temp, tp, tk, mt, sd, stop_text, sid, request: gr.Request):
        text = ""
        # Validate everything first: a bad value is a message, nothing stored, nothing sent.
        try:
            code_text, instruction_text = check_texts(code_text, instruction_text, mode_value)
            params = sampling(temp, tp, tk, mt, sd, stop_text)
            owner = admit_generation(ctx, request)
        except (InputError, Limited) as e:
            bad = MeterData(state="error", note="limited" if isinstance(e, Limited) else "invalid input")
            yield text, render(bad), error_html(str(e)), sid, False, asdict(bad)
            return
        page = page_key(ctx, request)
        me = next(generation_ids)
        current[page] = me  # a generation still running in this page sees it is superseded and ends quietly
        async with aclosing(_run(code_text, instruction_text, mode_value, params, sid, owner, (page, me))) as updates:
            async for update in updates:
                yield update

    async def _run(code_text, instruction_text, mode_value, params, sid, owner, who):
        page, me = who
        text = ""
        yield "", render(MeterData(state="queued" if ctx.engine.ready else "loading", note=ctx.engine.detail)), \
            error_html(""), sid, True, {}
        waited = time.monotonic()
        while not ctx.engine.ready:  # the engine is loading or restarting: wait for it, saying what it does
            if current.get(page) != me:
                if page not in current:  # Stop (not a newer Generate): say so
                    yield "", render(MeterData(state="done", note="stopped")), error_html(""), sid, False, {}
                return
            if time.monotonic() - waited > ENGINE_WAIT_S:
                yield "", render(MeterData(state="error")), error_html(
                    f"The engine is not ready ({ctx.engine.state}: {ctx.engine.detail})."), sid, False, {}
                return
            yield "", render(MeterData(state="loading", note=f"{ctx.engine.state}: {ctx.engine.detail}")), \
                error_html(""), sid, True, {}
            await asyncio.sleep(0.5)
        info = ctx.engine.info or {}
        body, chat = request_body(mode_value, code_text, instruction_text, params, None)
        timer = StreamTimer()
        meter_data = MeterData(state="queued", device=info.get("device"), dtype=info.get("dtype"), world_size=info.get("world_size"),
                               source="server" if info.get("laneplay", True) else "app")
        finish, server_timing, failure, usage = None, None, None, None
        last_push = 0.0
        events: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(stream_to(ctx, body, chat, events.put))
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), 0.1)
                except asyncio.TimeoutError:
                    ev = False
                if current.get(page) != me:  # Stop or a newer Generate: end here; cancelling the reader
                    finish = "cancelled"       # closes the stream, which the engine takes as a cancel
                    break
                if ev is False:
                    continue
                if ev is None:
                    break
                if isinstance(ev, EngineError):
                    failure = ev.message
                    if ev.kind == "unreachable" and not ctx.engine.ready:
                        failure += f" The engine is {ctx.engine.state}: {ctx.engine.detail}."
                    break
                if ev.kind == "queued":
                    meter_data.state, meter_data.note = "queued", f"position {ev.position} in the engine's queue"
                elif ev.kind == "running":
                    meter_data.state, meter_data.note = "running", "prefill"
                elif ev.kind == "delta":
                    c = timer.on_delta(ev.index, ev.text, (ev.timing or {}).get("finish_reason"))
                    text += ev.text
                    finish = c.finish_reason or finish
                    meter_data.state, meter_data.note = "running", ""
                    meter_data.tokens, meter_data.tps, meter_data.ttft_ms = c.tokens, c.decode_tps, c.ttft_ms
                    meter_data.ms_per_token, meter_data.latencies_ms = c.ms_per_token, c.latencies_ms
                elif ev.kind == "done":
                    server_timing, usage = ev.timing, ev.usage
                meter_data.elapsed_ms = timer.elapsed_ms()
                now = time.monotonic()
                if ev.kind != "delta" or now - last_push >= UPDATE_EVERY_S:
                    last_push = now
                    yield text, render(meter_data), error_html(""), sid, True, asdict(meter_data)
        finally:  # done, Stop, or the page went away: the stream is closed either way
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if current.get(page) == me:
                del current[page]
        superseded = finish == "cancelled" and page in current  # a newer Generate of this page took over
        meter_data.elapsed_ms = timer.elapsed_ms()
        if failure is not None:
            meter_data.state, meter_data.note = "error", ""
            yield text, render(meter_data), error_html(failure), sid, False, asdict(meter_data)
            return
        per_choice = (server_timing or {}).get("per_choice") or []
        if per_choice:  # the server's own timing is the final word
            t = per_choice[0]
            meter_data.ttft_ms = t.get("ttft_ms", meter_data.ttft_ms)
            meter_data.tps = t.get("decode_tokens_per_second", meter_data.tps)
            meter_data.ms_per_token = t.get("ms_per_token", meter_data.ms_per_token)
            meter_data.tokens = t.get("completion_tokens", meter_data.tokens) or meter_data.tokens
            meter_data.source = "server"
            meter_data.device = server_timing.get("device", meter_data.device)
            meter_data.dtype = server_timing.get("dtype", meter_data.dtype)
            meter_data.world_size = server_timing.get("world_size", meter_data.world_size)
            ctx.single_ms_per_token = meter_data.ms_per_token or ctx.single_ms_per_token  # Side by side's reference
        else:
            meter_data.source = "app"
        meter_data.state = "done"
        meter_data.note = "stopped" if finish == "cancelled" else f"finish: {finish or 'stop'}"
        if superseded:  # keep what was made, say nothing: the page shows the newer request
            if text:
                _store(ctx, sid, owner, code_text, instruction_text, params, mode_value, text, timer, None,
                       finish, info, meter_data)
            return
        try:
            server = dict(per_choice[0]) if per_choice else {}
            server["prompt_tokens"] = (usage or {}).get("prompt_tokens") or 0
            sid = _store(ctx, sid, owner, code_text, instruction_text, params, mode_value, text, timer,
                         server, finish, info, meter_data)
            problem = ""
        except ValidationError as e:
            problem = f"The generation was not stored: {e}"
        yield text, render(meter_data), error_html(problem), sid, False, asdict(meter_data)

    generate.click(run, [code, instruction, mode, temperature, top_p, top_k, max_tokens, seed, stops,
                                 session_id], [output, meter, error, session_id, busy, last],
                           concurrency_limit=None, api_name="generate", show_progress="hidden",
                           trigger_mode="multiple")

    def stop_now(request: gr.Request):
        """Stop: the running generation of this page ends at once and says so (see `_run`)."""
        current.pop(page_key(ctx, request), None)

    stop.click(stop_now, None, None, api_name="stop", show_progress="hidden", queue=False)
    insert.click(lambda out, cur: out if out.strip() else cur, [output, code], [code], api_name="insert", show_progress="hidden")

    def make_share(sid, request: gr.Request):
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

    share.click(make_share, [session_id], [share_box, error], api_name="share", show_progress="hidden")

    def tick():
        """Once a second, the engine's state line. It never touches the meter or the error line (a running
        request owns those); meter.js follows this line for a resting meter and a lost engine."""
        return engine_line(ctx)

    gr.Timer(1.0).tick(tick, None, [engine_status], concurrency_limit=None, show_progress="hidden")
    return {"code": code, "instruction": instruction, "mode": mode, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "max_tokens": max_tokens, "seed": seed, "stops": stops, "output": output,
            "meter": meter, "error": error, "share_box": share_box, "busy": busy, "last": last,
            "make_share": make_share}


def _store(ctx, sid, owner, code_text, instruction_text, params, mode_value, text, timer, server, finish, info,
           meter_data: MeterData | None = None) -> str:
    """The generation and the editor state it came from, in the session (created on first use)."""
    c = timer.choices.get(0)
    record = {"sample_index": 0, "seed": params.get("seed"), "temperature": params["temperature"], "text": text,
              "finish_reason": finish or "stop",
              "completion_tokens": (server or {}).get("completion_tokens") or (c.tokens if c else 0),
              "prompt_tokens": (server or {}).get("prompt_tokens") or 0,
              "ttft_ms": (server or {}).get("ttft_ms", c.ttft_ms if c else None),
              "decode_tokens_per_second": (server or {}).get("decode_tokens_per_second", c.decode_tps if c else None),
              "ms_per_token": (server or {}).get("ms_per_token", c.ms_per_token if c else None),
              "device": (meter_data.device if meter_data else info.get("device")) or None,
              "world_size": (meter_data.world_size if meter_data else info.get("world_size")) or None}
    stored_params = {k: params[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
                     if k in params}
    stored_params["top_k"] = min(stored_params.get("top_k", 0), 1000)
    return save_batch(ctx, sid, owner, code_text, instruction_text, info, [record], params=stored_params)[0]


def save_batch(ctx, sid, owner, code_text, instruction_text, info, records: list[dict], params: dict | None = None,
               **fields) -> tuple[str, int]:
    """One batch of generations and the editor state it came from, in the session (created on first use,
    when this browser does not own `sid`). `params`: the session's sampling settings (None: kept as they
    are); `fields`: other session fields (e.g. columns). Returns (session id, batch number)."""
    fields = dict(code=code_text, instruction=instruction_text, model=str(info.get("model") or "")[:200],
                  device=str(info.get("device") or "")[:32],
                  world_size=max(1, min(int(info.get("world_size") or 1), 8)), **fields)
    if params is not None:
        fields["params"] = params
    if not sid or not ctx.store.owns(sid, owner):
        sid = ctx.store.create_session(title=session_title(code_text, instruction_text), owner=owner,
                                       **{"params": {}, **fields})
    else:
        ctx.store.update_session(sid, owner=owner, **fields)
    return sid, ctx.store.add_generations(sid, records, owner=owner)
