"""The web app: a Gradio Blocks UI mounted in FastAPI, next to the share pages and a status endpoint.

Routes: `/` the UI (tabs Playground, Side by side, pass@N, DTP and History), `/s/<token>` a read-only
share page and `/s/<token>/fork` (POST) to copy it into the viewer's own session, `/api/status` the
engine's state as JSON, `/api/runs/<id>/sample` one checked sample of this browser's pass@N run (and
`/s/<token>/runs/<n>/sample` of a shared one), `/static/lp/...` our CSS and JS.

A browser is its owner cookie (`app.owners`: a random id this server signed; HttpOnly, SameSite=Lax,
Secure over HTTPS). Every page load that comes without a valid one gets a new one, never adopting a value
the server did not sign; everything of a session, run or link is answered only to its owner.
"""
from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import re
import secrets
from contextlib import asynccontextmanager
from importlib import resources

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse  # noqa: E402
from fastapi.staticfiles import StaticFiles  # noqa: E402

from laneplay.app import dtpview, history, passn, passn_view, playground, sidebyside  # noqa: E402
from laneplay.app import owners, pages  # noqa: E402
from laneplay.app.context import AppContext  # noqa: E402
from laneplay.app.meter import MeterData, of_stored, render  # noqa: E402
from laneplay.app.quota import Limited  # noqa: E402
from laneplay.storage import LimitReached, share  # noqa: E402

log = logging.getLogger("laneplay.app")
STATIC_URL = "/static/lp"  # Gradio owns /static itself
GRADIO_API = "/gradio_api/"
MAX_API_BODY = 4 * 2**20  # a Gradio event's JSON body (inputs are bounded far below this)
NOT_FOUND = "This link does not exist or was revoked"
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}
_SCRIPT_TAG = re.compile(rb"<script(?=[\s>])")


def content_security_policy(nonce: str | None) -> str:
    """Nothing from other hosts, no framing. The Gradio page runs its inline bootstrap scripts by nonce (and
    what they load, 'strict-dynamic'); Gradio evaluates event `js` snippets and sets inline styles, which is
    why 'unsafe-eval' and style 'unsafe-inline' are there. Our own pages load only our script files."""
    scripts = f"'self' 'nonce-{nonce}' 'strict-dynamic' 'unsafe-eval'" if nonce else "'self'"
    return "; ".join([
        "default-src 'self'", f"script-src {scripts}", "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data: blob:", "font-src 'self' data:", "connect-src 'self'", "media-src 'self' blob:",
        "worker-src 'self' blob:", "manifest-src 'self'", "object-src 'none'", "base-uri 'self'",
        "form-action 'self'", "frame-ancestors 'none'"])


SHARE_HEADERS = {"Cache-Control": "no-store"}  # (and SECURITY_HEADERS, as every answer)
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
            with gr.Tab("Side by side", id="side-by-side", elem_id="tab-side-by-side") as sbs_tab:
                sbs = sidebyside.build(ctx, session_id, pg, tabs)
            with gr.Tab("pass@N", id="passn", elem_id="tab-passn") as passn_tab:
                pn = passn.build(ctx, session_id, pg)
            with gr.Tab("DTP", id="dtp", elem_id="tab-dtp") as dtp_tab:
                dv = dtpview.build(ctx, pg)
            with gr.Tab("History", id="history", elem_id="tab-history") as history_tab:
                hist = history.build(ctx, session_id, pg, tabs, pn)
        history_tab.select(hist["refresh"], None, hist["outputs"], show_progress="hidden")
        passn_tab.select(pn["refresh_runs"], None, [pn["runs"]], show_progress="hidden")
        sbs_tab.select(sbs["refresh"], sbs["refresh_inputs"], sbs["refresh_outputs"], show_progress="hidden")
        dtp_tab.select(dv["refresh"], None, dv["refresh_outputs"], show_progress="hidden")

        def on_load(request: gr.Request):
            """A fork lands on /?session=<id>: open it when this browser owns it (the page then takes the id
            out of its address bar, see CLEAN_URL)."""
            sid = dict(request.query_params).get("session")
            s = ctx.store.get_session(sid, owner=ctx.owner_of(request)) if sid else None
            if s is None:
                return None, gr.update(), gr.update(), gr.update(), gr.update(), playground.idle_meter(ctx), {}
            record = history.stored_meter(s, "forked") or {}
            meter = render(MeterData(**record)) if record else playground.idle_meter(ctx)
            text = s["generations"][-1]["text"] if s["generations"] else ""
            return sid, s["code"], s["instruction"], s["mode"] or gr.update(), text, meter, record

        demo.load(on_load, None, [session_id, pg["code"], pg["instruction"], pg["mode"], pg["output"], pg["meter"],
                                  pg["last"]],
                  show_progress="hidden").then(None, None, None, js=CLEAN_URL)
        demo.load(pn["on_load"], None, pn["load_outputs"], show_progress="hidden")
    demo.queue(default_concurrency_limit=None, max_size=256)
    return demo


def create_app(ctx: AppContext) -> FastAPI:
    interrupted = ctx.store.interrupt_unfinished()  # runs of a server that stopped: kept, marked interrupted
    if interrupted:
        log.warning("%d pass@N run(s) of a previous server were left unfinished; marked interrupted", interrupted)

    demo = build_ui(ctx)
    reaper = pages.PageReaper(demo)

    @asynccontextmanager
    async def lifespan(_app):
        sweeper = asyncio.create_task(reaper.run(), name="page sweeper")
        yield
        sweeper.cancel()
        await ctx.jobs.shutdown()  # running jobs end as interrupted, with what they finished

    app = FastAPI(title="Laneplay", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.reaper = reaper

    @app.middleware("http")
    async def owner_cookie(request: Request, call_next):
        """A page load without a cookie this server signed gets a new owner id (a made-up or edited cookie
        is replaced, never adopted); one signed with an older key is re-signed, same owner."""
        response = await call_next(request)
        if response.headers.get("content-type", "").startswith("text/html"):
            owner, current = ctx.owners.read(request.cookies.get(owners.COOKIE))
            if owner is None or not current:
                set_owner_cookie(request, response, ctx.owners.issue(owner)[1])
        return response

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        """Every answer: no sniffing, no framing, no referrer; HTML pages under a Content-Security-Policy
        (the Gradio page's inline scripts carry a per-answer nonce)."""
        response = await call_next(request)
        html_page = response.headers.get("content-type", "").startswith("text/html")
        if html_page and not request.url.path.startswith(("/s/", GRADIO_API)) and response.status_code == 200:
            nonce = secrets.token_urlsafe(18)
            body = b"".join([chunk async for chunk in response.body_iterator])
            body = _SCRIPT_TAG.sub(f'<script nonce="{nonce}"'.encode(), body)
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "set-cookie")}
            rebuilt = HTMLResponse(body, status_code=response.status_code, headers=headers)
            for k, v in response.headers.raw:
                if k.lower() == b"set-cookie":
                    rebuilt.raw_headers.append((k, v))
            response = rebuilt
            response.headers["Content-Security-Policy"] = content_security_policy(nonce)
        elif html_page:
            response.headers["Content-Security-Policy"] = content_security_policy(None)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    page_owners = pages.PageOwners()
    generating = {i for i, fn in demo.fns.items() if fn.api_name in GENERATING}

    @app.middleware("http")
    async def page_owner(request: Request, call_next):
        """Gradio's API, guarded per page. A page id belongs to the browser that first used it: naming another
        browser's page (its events, states, stream, heartbeat) is a 403. A Generate from a script (a page
        with no heartbeat) over the quota is a 429 before Gradio holds a page for it; a browser page is
        answered in the page (#error). An address opens new pages at a bounded rate (429 past it)."""
        if not request.url.path.startswith(GRADIO_API):
            return await call_next(request)
        body = None
        if request.method == "POST" and not request.headers.get("content-type", "").startswith("multipart/"):
            try:  # a body is read whole to find the page it names: so it must say its size, and be small
                length = int(request.headers.get("content-length", ""))
            except ValueError:
                return JSONResponse({"error": "A request body needs a Content-Length."}, status_code=411)
            if length > MAX_API_BODY:
                return JSONResponse({"error": "The request body is too large."}, status_code=413)
            try:
                body = json.loads(await request.body() or b"null")
            except ValueError:
                body = None
        owner, address = ctx.owner_of(request), ctx.address_of(request)
        named = pages.page_ids(request.url.path, dict(request.query_params), body)
        fresh = False
        for page in named:
            allowed, new = page_owners.claim(page, owner)
            if not allowed:
                return JSONResponse({"error": "This page belongs to another browser. Reload the page."},
                                    status_code=403, headers={"Cache-Control": "no-store"})
            fresh |= new
        try:
            if owner and not any(p in reaper.heartbeats for p in named) and \
                    calls_generation(request.url.path, body, generating):
                ctx.quota.generation(owner, address, take=False)
            if fresh:
                ctx.quota.new_page(address)
        except Limited as e:
            return JSONResponse({"error": str(e)}, status_code=429,
                                headers={"Retry-After": str(int(e.retry_after_s)), "Cache-Control": "no-store"})
        beating = pages.heartbeat_page(request.url.path)
        if beating:
            reaper.heartbeats.add(beating)  # a browser page: its state stays while the heartbeat is open
        return await call_next(request)

    @app.get("/api/status")
    async def status():
        return JSONResponse(ctx.engine.status(), headers={"Cache-Control": "no-store"})

    @app.get("/s/{token}", response_class=HTMLResponse)
    async def shared(token: str):
        snap = ctx.store.get_shared(token)
        if snap is None:
            return HTMLResponse(not_found_page(), status_code=404, headers=SHARE_HEADERS)
        return HTMLResponse(share_page(token, snap), headers=SHARE_HEADERS)

    @app.get("/api/runs/{run_id}/sample")
    async def run_sample(run_id: str, request: Request, problem: str = "", greedy: int = 0, index: int = 0):
        """A sample of one of this browser's runs (the grid's cells); nobody else's."""
        run = ctx.store.get_comparison(run_id, owner=ctx.owner_of(request))
        if run is None:
            return JSONResponse({"error": "not found"}, status_code=404, headers=SHARE_HEADERS)
        rec = sample_record(run, problem, greedy, index)
        return JSONResponse(rec or {"error": "not found"}, status_code=200 if rec else 404, headers=SHARE_HEADERS)

    @app.get("/s/{token}/runs/{position}/sample")
    async def shared_sample(token: str, position: int, problem: str = "", greedy: int = 0, index: int = 0):
        """A sample of a run inside a share link's snapshot (as frozen then; runs go by position)."""
        snap = ctx.store.get_shared(token)
        runs = (snap or {}).get("comparisons") or []
        run = runs[position] if 0 <= position < len(runs) else None
        rec = sample_record(run, problem, greedy, index)
        return JSONResponse(rec or {"error": "not found"}, status_code=200 if rec else 404, headers=SHARE_HEADERS)

    @app.post("/api/forget")
    async def forget(request: Request):
        """History's "Forget this browser": every session, run and link of this browser is deleted and its
        cookie cleared. Only from a page of this app: a form post of another site carries no Lax cookie, and
        is refused by its Sec-Fetch-Site or Origin as well (pages send no referrer, so a browser's own
        form post says Origin "null")."""
        origin = request.headers.get("origin")
        site = request.headers.get("sec-fetch-site")
        if (site is not None and site not in ("same-origin", "none")) or \
                (origin not in (None, "null") and origin.rstrip("/") != str(request.base_url).rstrip("/")):
            return JSONResponse({"error": "forbidden"}, status_code=403, headers=SHARE_HEADERS)
        owner = ctx.owner_of(request)
        if owner is not None:
            run = ctx.jobs.active_run(owner)
            if run is not None:
                ctx.jobs.cancel(run, owner)
            n = ctx.store.forget_owner(owner=owner)
            log.info("a browser asked to be forgotten: %d session(s) deleted", n)
        response = RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})
        response.delete_cookie(owners.COOKIE, path="/", httponly=True, samesite="lax",
                               secure=request.url.scheme == "https")
        return response

    @app.post("/s/{token}/fork")
    async def fork(token: str, request: Request):
        owner, new_cookie = ctx.owner_of(request), None
        if owner is None:  # a browser that came straight to the POST (or with a cookie we never signed)
            owner, new_cookie = ctx.owners.issue()
        try:
            ctx.quota.fork(ctx.address_of(request))
            sid = ctx.store.fork_shared(token, owner=owner)
        except Limited as e:
            return limited_page(str(e), e.retry_after_s)
        except LimitReached as e:
            return limited_page(f"Not forked: {str(e).removeprefix('owner: ')}.", 60)
        if sid is None:
            return HTMLResponse(not_found_page(), status_code=404, headers=SHARE_HEADERS)
        response = RedirectResponse(f"/?session={sid}", status_code=303, headers={"Cache-Control": "no-store"})
        if new_cookie:
            set_owner_cookie(request, response, new_cookie)
        return response

    app.mount(STATIC_URL, StaticFiles(directory=static_dir()), name="laneplay-static")
    head = (f'<link rel="stylesheet" href="{STATIC_URL}/laneplay.css">'
            f'<link rel="stylesheet" href="{STATIC_URL}/passn.css">'
            f'<script src="{STATIC_URL}/meter.js" defer></script><script src="{STATIC_URL}/passn.js" defer></script>'
            f'<script src="{STATIC_URL}/tokenview.js" defer></script>')
    return gr.mount_gradio_app(app, demo, path="/", head=head, theme=THEME, footer_links=[],
                               css=".lp-title{font-size:18px;padding:2px 0}")


GENERATING = ("generate", "side_by_side", "dtp_ab")  # the events that take a Generate from the quota
_BY_NAME = re.compile(r"/(?:run|call|api)(?:/v2)?/(" + "|".join(GENERATING) + r")/?$")


def calls_generation(path: str, body: object, fn_indices: set[int]) -> bool:
    """Does this Gradio request start one of the GENERATING events (by index, or by its API name)?"""
    if isinstance(body, dict) and body.get("fn_index") in fn_indices:
        return True
    return bool(_BY_NAME.search(path))


def set_owner_cookie(request: Request, response, value: str) -> None:
    response.set_cookie(owners.COOKIE, value, max_age=owners.MAX_AGE_S, httponly=True, samesite="lax", path="/",
                        secure=request.url.scheme == "https")


def limited_page(message: str, retry_after_s: float) -> HTMLResponse:
    """429: what was limited and when to try again (the page says it; Retry-After says it to programs)."""
    return HTMLResponse(_page("Too many requests · Laneplay", f"<h1>Too many requests</h1><p id='limited'>"
                                                              f"{html.escape(message)}</p><p><a href='/'>Back to "
                                                              "the Laneplay playground</a></p>"),
                        status_code=429, headers={**SHARE_HEADERS, "Retry-After": str(int(retry_after_s))})


# After a fork opened its session, the address bar drops the session id (it would travel in screenshots
# and chats); a reload then starts a fresh page, and History has the session.
CLEAN_URL = ("() => { const u = new URL(window.location.href); if (u.searchParams.has('session')) { "
             "u.searchParams.delete('session'); window.history.replaceState(null, '', u.pathname + u.search + u.hash); } }")


# ---- the share page (plain HTML: no Gradio, nothing to load but our stylesheet and script) -------------

def _page(title: str, body: str) -> str:
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            "<meta name='referrer' content='no-referrer'>"
            f"<title>{html.escape(title)}</title><link rel='stylesheet' href='{STATIC_URL}/laneplay.css'>"
            f"<link rel='stylesheet' href='{STATIC_URL}/share.css'>"
            f"<link rel='stylesheet' href='{STATIC_URL}/passn.css'>"
            f"<script src='{STATIC_URL}/meter.js' defer></script>"
            f"<script src='{STATIC_URL}/passn.js' defer></script>"
            f"</head><body><main class='lp-share-page'>{body}</main></body></html>")


def share_runs(token: str, runs: list[dict]) -> str:
    """A snapshot's pass@N runs, read-only: progress, grid (cells open their code), table and chart each;
    one chart of them all when there are several. The newest run carries the tab's element ids."""
    if not runs:
        return ""
    parts = []
    newest_first = sorted(enumerate(runs), key=lambda x: x[1].get("created_at") or "", reverse=True)
    for i, (position, run) in enumerate(newest_first):
        sfx = "" if i == 0 else f"-{i}"
        src = f"/s/{token}/runs/{position}/sample"  # a snapshot holds no run ids: runs go by position
        grid = passn_view.grid_html(run, src, "passn-grid" + sfx, "passn-detail" + sfx)
        parts.append(f"<section class='lp-run'><h3>{html.escape(passn_view.label(run))}</h3>"
                     f"{passn_view.progress_html(run, elem_id='passn-progress' + sfx)}"
                     f"<div class='lp-run-cols'><div>{grid}{passn_view.detail_box('passn-detail' + sfx)}</div><div>"
                     f"{passn_view.table_html(run, 'passn-table' + sfx)}"
                     f"{passn_view.chart_svg([run], 'passn-chart' + sfx)}</div></div></section>")
    if len(runs) > 1:
        parts.append(f"<h3>All runs compared</h3>{passn_view.compare_html(runs)}"
                     f"{passn_view.chart_svg(runs, 'passn-compare-chart')}")
    return "<h2>pass@N runs</h2>" + "".join(parts)


def sample_record(run: dict | None, problem: str, greedy: int, index: int) -> dict | None:
    """One checked sample of a run, for a clicked grid cell."""
    for r in (run or {}).get("results") or []:
        if r["problem_id"] == problem and bool(r["greedy"]) == bool(greedy) and r["sample_index"] == index:
            return {k: r[k] for k in ("problem_id", "greedy", "sample_index", "status", "error", "runtime_s",
                                      "completion_tokens", "code")}
    return None


def not_found_page() -> str:
    return _page("Not found · Laneplay", f"<h1>{NOT_FOUND}</h1><p><a href='/'>Open the Laneplay playground</a></p>")


def share_page(token: str, snap: dict) -> str:
    """The snapshot, read-only: code, instruction, parameters, every output with its meter, pass@N runs."""
    esc = html.escape
    params = snap.get("params") or {}
    param_text = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items()) or "defaults"
    gens = snap.get("generations") or []
    outputs, batches = [], set()
    plain = [g for g in gens if g.get("kind") != "side-by-side"]
    for g in reversed(gens):  # side-by-side batches as columns (newest first), then the Playground's outputs
        if g.get("kind") == "side-by-side" and g["batch"] not in batches:
            batches.add(g["batch"])
            outputs.append(sidebyside.share_html([x for x in gens if x["batch"] == g["batch"]]))
    for i, g in enumerate(reversed(plain)):
        meter = render(of_stored(g), elem_id="meter" if i == 0 else f"meter-{i}", compact=True)
        outputs.append(f"<section class='lp-gen'><h3>Output {len(plain) - i} · seed {esc(str(g['seed']))} · "
                       f"temperature {esc(str(g['temperature']))}</h3>{sidebyside.asked_html(g)}{meter}"
                       f"<pre class='lp-code' {'id=output' if i == 0 else ''}>{esc(g['text'])}</pre></section>")
    runs = share_runs(token, snap.get("comparisons") or [])
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
            + runs)
    return _page(f"{snap.get('title') or 'Shared session'} · Laneplay", body)


__all__ = ["create_app", "build_ui", "share_page", "not_found_page", "share"]
