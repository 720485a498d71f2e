"""The web app: a Gradio Blocks UI mounted in FastAPI, next to the share pages and a status endpoint.

Routes: `/` the UI (tabs Playground and History), `/s/<token>` a read-only share page and
`/s/<token>/fork` (POST) to copy it into the viewer's own session, `/api/status` the engine's state as
JSON, `/static/lp/...` our CSS and JS. Every response carries the browser's owner cookie (random,
HttpOnly, SameSite=Lax), which is what History and ownership checks go by.
"""
from __future__ import annotations

import html
import json
import os
from importlib import resources

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse  # noqa: E402
from fastapi.staticfiles import StaticFiles  # noqa: E402

from laneplay.app import history, playground  # noqa: E402
from laneplay.app.context import OWNER_COOKIE, AppContext, new_owner_id, owner_of  # noqa: E402
from laneplay.app.meter import MeterData, render  # noqa: E402
from laneplay.storage import share  # noqa: E402

STATIC_URL = "/static/lp"  # Gradio owns /static itself
NOT_FOUND = "This link does not exist or was revoked"
SHARE_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
                 "X-Frame-Options": "DENY"}
THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"])


def static_dir() -> str:
    return str(resources.files("laneplay.static"))


def build_ui(ctx: AppContext) -> gr.Blocks:
    with gr.Blocks(title="Laneplay", analytics_enabled=False) as demo:
        gr.HTML("<div class='lp-title'><b>Laneplay</b> · latency-first playground for code LLMs</div>")
        session_id = gr.State(None)
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Playground", id="playground", elem_id="tab-playground"):
                pg = playground.build(ctx, session_id)
            with gr.Tab("History", id="history", elem_id="tab-history") as history_tab:
                hist = history.build(ctx, session_id, pg, tabs)
        history_tab.select(hist["refresh"], None, [hist["table"], hist["ids"], hist["count"]], show_progress="hidden")

        def on_load(request: gr.Request):
            """A fork lands on /?session=<id>: open it when this browser owns it."""
            sid = dict(request.query_params).get("session")
            s = ctx.store.get_session(sid, owner=owner_of(request)) if sid else None
            if s is None:
                return None, gr.update(), gr.update(), gr.update(), playground.idle_meter(ctx), {}
            record = history.stored_meter(s, "forked") or {}
            meter = render(MeterData(**record)) if record else playground.idle_meter(ctx)
            text = s["generations"][-1]["text"] if s["generations"] else ""
            return sid, s["code"], s["instruction"], text, meter, record

        demo.load(on_load, None, [session_id, pg["code"], pg["instruction"], pg["output"], pg["meter"], pg["last"]],
                  show_progress="hidden")
    demo.queue(default_concurrency_limit=None, max_size=256)
    return demo


def create_app(ctx: AppContext) -> FastAPI:
    app = FastAPI(title="Laneplay", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def owner_cookie(request: Request, call_next):
        """Every browser gets a random owner id on its first visit; sessions are listed by it."""
        response = await call_next(request)
        if owner_of(request) is None and response.headers.get("content-type", "").startswith("text/html"):
            response.set_cookie(OWNER_COOKIE, new_owner_id(), max_age=400 * 24 * 3600, httponly=True,
                                samesite="lax", path="/")
        return response

    @app.get("/api/status")
    async def status():
        return JSONResponse(ctx.engine.status(), headers={"Cache-Control": "no-store"})

    @app.get("/s/{token}", response_class=HTMLResponse)
    async def shared(token: str):
        snap = ctx.store.get_shared(token)
        if snap is None:
            return HTMLResponse(not_found_page(), status_code=404, headers=SHARE_HEADERS)
        return HTMLResponse(share_page(token, snap), headers=SHARE_HEADERS)

    @app.post("/s/{token}/fork")
    async def fork(token: str, request: Request):
        owner = owner_of(request)
        new_cookie = None
        if owner is None:  # a browser that came straight to the POST: give it an owner id now
            owner = new_cookie = new_owner_id()
        sid = ctx.store.fork_shared(token, owner=owner)
        if sid is None:
            return HTMLResponse(not_found_page(), status_code=404, headers=SHARE_HEADERS)
        response = RedirectResponse(f"/?session={sid}", status_code=303, headers={"Cache-Control": "no-store"})
        if new_cookie:
            response.set_cookie(OWNER_COOKIE, new_cookie, max_age=400 * 24 * 3600, httponly=True, samesite="lax",
                                path="/")
        return response

    app.mount(STATIC_URL, StaticFiles(directory=static_dir()), name="laneplay-static")
    head = (f'<link rel="stylesheet" href="{STATIC_URL}/laneplay.css">'
            f'<script src="{STATIC_URL}/meter.js" defer></script>')
    return gr.mount_gradio_app(app, build_ui(ctx), path="/", head=head, theme=THEME, footer_links=[],
                               css=".lp-title{font-size:18px;padding:2px 0}")


# ---- the share page (plain HTML: no Gradio, nothing to load but our stylesheet and script) -------------

def _page(title: str, body: str) -> str:
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            "<meta name='referrer' content='no-referrer'>"
            f"<title>{html.escape(title)}</title><link rel='stylesheet' href='{STATIC_URL}/laneplay.css'>"
            f"<link rel='stylesheet' href='{STATIC_URL}/share.css'><script src='{STATIC_URL}/meter.js' defer></script>"
            f"</head><body><main class='lp-share-page'>{body}</main></body></html>")


def not_found_page() -> str:
    return _page("Not found · Laneplay", f"<h1>{NOT_FOUND}</h1><p><a href='/'>Open the Laneplay playground</a></p>")


def share_page(token: str, snap: dict) -> str:
    """The snapshot, read-only: code, instruction, parameters, every output with its meter, pass@N runs."""
    esc = html.escape
    params = snap.get("params") or {}
    param_text = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items()) or "defaults"
    gens = snap.get("generations") or []
    outputs = []
    for i, g in enumerate(reversed(gens)):
        meter = render(MeterData(state="done", tokens=g["completion_tokens"] or 0, tps=g["decode_tokens_per_second"],
                                 ttft_ms=g["ttft_ms"], ms_per_token=g["ms_per_token"], device=g["device"],
                                 world_size=g["world_size"], note=f"finish: {g['finish_reason'] or '–'}"),
                       elem_id="meter" if i == 0 else f"meter-{i}", compact=True)
        outputs.append(f"<section class='lp-gen'><h3>Output {len(gens) - i} · seed {esc(str(g['seed']))} · "
                       f"temperature {esc(str(g['temperature']))}</h3>{meter}"
                       f"<pre class='lp-code' {'id=output' if i == 0 else ''}>{esc(g['text'])}</pre></section>")
    runs = []
    for c in snap.get("comparisons") or []:
        passk = ", ".join(f"pass@{p['k']} = {p['value']:.3f}" for p in c.get("passk") or []) or "unfinished"
        runs.append(f"<li>{esc(c['problem_set'])}: {len(c['problem_ids'])} problems, N={c['n']}, "
                    f"T={c['temperature']}: {esc(passk)}; greedy pass@1 = {esc(str(c.get('greedy_pass1')))}</li>")
    body = (f"<header><a href='/' class='lp-brand'>Laneplay</a> · shared session (read-only snapshot from "
            f"{esc((snap.get('shared_at') or '')[:19].replace('T', ' '))} UTC)</header>"
            f"<h1>{esc(snap.get('title') or 'Untitled session')}</h1>"
            f"<p class='lp-muted'>model {esc(snap.get('model') or '–')} · {esc(snap.get('device') or '–')} × "
            f"{esc(str(snap.get('world_size') or 1))} · {esc(param_text)}</p>"
            f"<form method='post' action='/s/{esc(token)}/fork'><button id='fork' type='submit'>Fork into my own "
            f"session</button></form>"
            f"<h2>Instruction</h2><pre class='lp-text' id='instruction'>{esc(snap.get('instruction') or '')}</pre>"
            f"<h2>Code</h2><pre class='lp-code' id='code'>{esc(snap.get('code') or '')}</pre>"
            f"<h2>Outputs</h2>{''.join(outputs) or '<p>No outputs yet.</p>'}"
            + (f"<h2>pass@N runs</h2><ul>{''.join(runs)}</ul>" if runs else ""))
    return _page(f"{snap.get('title') or 'Shared session'} · Laneplay", body)


__all__ = ["create_app", "build_ui", "share_page", "not_found_page", "share"]
