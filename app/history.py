"""The History tab: this browser's sessions only (by its owner cookie); reopen, rename, delete, revoke links."""
from __future__ import annotations

import html
import itertools
from dataclasses import asdict

import gradio as gr

from laneplay.app.context import AppContext, owner_of
from laneplay.app.meter import MeterData, render
from laneplay.storage import ValidationError

COLUMNS = ["Title", "Model", "Updated (UTC)", "Best tokens/s", "Generations", "Share links"]


def rows(ctx: AppContext, owner: str | None) -> tuple[list[list], list[str]]:
    if owner is None:
        return [], []
    sessions = ctx.store.list_sessions(limit=200, owner=owner)
    table = [[s["title"] or "Untitled session", s["model"] or "–", (s["updated_at"] or "")[:19].replace("T", " "),
              round(s["best_tokens_per_second"], 1) if s["best_tokens_per_second"] else None,
              s["generations"], s["share_links"]] for s in sessions]
    return table, [s["id"] for s in sessions]


def links_html(ctx: AppContext, sid: str | None) -> str:
    if not sid:
        return ""
    links = ctx.store.list_shares(sid)
    if not links:
        return "<p class='lp-muted'>No live share links for this session.</p>"
    items = "".join(f"<li>link <code>{html.escape(x['link'][:8])}</code> created "
                    f"{html.escape((x['created_at'] or '')[:19].replace('T', ' '))} UTC</li>" for x in links)
    return f"<ul class='lp-links'>{items}</ul>"


def stored_meter(session: dict, note: str) -> dict | None:
    """The meter record of a session's latest generation (None if it has none)."""
    gens = session["generations"]
    if not gens:
        return None
    g = gens[-1]
    return asdict(MeterData(state="done", tokens=g["completion_tokens"] or 0, tps=g["decode_tokens_per_second"],
                            ttft_ms=g["ttft_ms"], ms_per_token=g["ms_per_token"], device=g["device"],
                            world_size=g["world_size"], note=note))


def build(ctx: AppContext, session_id: gr.State, pg: dict, tabs: gr.Tabs) -> dict:
    gr.Markdown("Sessions of this browser (kept in the app's database; other browsers never see them).")
    count = gr.HTML('<span id="history-count" data-count="" data-seq="0"></span>', elem_id="history-count-box")
    ids = gr.State([])
    selected = gr.State(None)
    table = gr.Dataframe(headers=COLUMNS, value=[], interactive=False, elem_id="history", wrap=True,
                         column_widths=["34%", "16%", "16%", "12%", "11%", "11%"])
    with gr.Row():
        title = gr.Textbox(label="Selected session", placeholder="select a row above", elem_id="history-title",
                           interactive=True, scale=3)
        open_btn = gr.Button("Open in Playground", elem_id="history-open", scale=1)
        rename_btn = gr.Button("Rename", elem_id="history-rename", scale=1)
        delete_btn = gr.Button("Delete", variant="stop", elem_id="history-delete", scale=1)
    links = gr.HTML("", elem_id="history-links")
    with gr.Row():
        link_choice = gr.Dropdown(choices=[], label="Share link to revoke", elem_id="history-link",
                                  interactive=True, scale=3)
        revoke_btn = gr.Button("Revoke link", elem_id="revoke", scale=1)
    notice = gr.Markdown("", elem_id="history-notice")

    refreshes = itertools.count(1)

    def refresh(request: gr.Request):
        table_rows, session_ids = rows(ctx, owner_of(request))
        n = len(session_ids)
        summary = (f'<span id="history-count" data-count="{n}" data-seq="{next(refreshes)}">'
                   f'{n} session{"s" if n != 1 else ""}</span>')
        return table_rows, session_ids, summary

    def pick(session_ids, evt: gr.SelectData, request: gr.Request):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        if row is None or row >= len(session_ids):
            return None, "", "", gr.update(choices=[], value=None)
        sid = session_ids[row]
        s = ctx.store.get_session(sid, owner=owner_of(request))
        if s is None:
            return None, "", "", gr.update(choices=[], value=None)
        choices = [(f"{x['link'][:8]} ({(x['created_at'] or '')[:19].replace('T', ' ')})", x["link"])
                   for x in ctx.store.list_shares(sid)]
        return sid, s["title"], links_html(ctx, sid), gr.update(choices=choices, value=choices[0][1] if choices else None)

    def rename(sid, new_title, request: gr.Request):
        if not sid or not ctx.store.owns(sid, owner_of(request)):
            return "Select one of your sessions first."
        try:
            ctx.store.update_session(sid, title=(new_title or "").strip() or "Untitled session")
        except ValidationError as e:
            return f"Not renamed: {e}"
        return "Renamed."

    def delete(sid, request: gr.Request):
        if not sid or not ctx.store.owns(sid, owner_of(request)):
            return "Select one of your sessions first.", sid
        ctx.store.delete_session(sid)
        return "Deleted (its share links are gone too).", None

    def revoke(sid, link, request: gr.Request):
        if not sid or not ctx.store.owns(sid, owner_of(request)) or not link:
            return "Select a session and one of its links first.", links_html(ctx, sid), gr.update()
        ok = ctx.store.revoke_link(sid, link)
        choices = [(f"{x['link'][:8]} ({(x['created_at'] or '')[:19].replace('T', ' ')})", x["link"])
                   for x in ctx.store.list_shares(sid)]
        return ("Revoked: the link now shows “does not exist or was revoked”." if ok else "That link was already gone."), \
            links_html(ctx, sid), gr.update(choices=choices, value=choices[0][1] if choices else None)

    def open_session(sid, request: gr.Request):
        s = ctx.store.get_session(sid, owner=owner_of(request)) if sid else None
        if s is None:
            return (gr.update(),) * 10 + ("Select one of your sessions first.", gr.update())
        p = s["params"] or {}
        record = stored_meter(s, "reopened")
        return (sid, s["code"], s["instruction"], p.get("temperature", 0.0), p.get("top_p", 1.0), p.get("top_k", 0),
                p.get("max_tokens", 256), s["generations"][-1]["text"] if s["generations"] else "",
                render(MeterData(**record)) if record else gr.update(), record or {}, "",
                gr.Tabs(selected="playground"))

    quiet = {"show_progress": "hidden"}  # no progress timers inside the notice or the table
    reload = (refresh, None, [table, ids, count])
    table.select(pick, [ids], [selected, title, links, link_choice], **quiet)
    rename_btn.click(rename, [selected, title], [notice], **quiet).then(*reload, **quiet)
    delete_btn.click(delete, [selected], [notice, selected], **quiet).then(*reload, **quiet)
    revoke_btn.click(revoke, [selected, link_choice], [notice, links, link_choice], **quiet).then(*reload, **quiet)
    open_btn.click(open_session, [selected], [session_id, pg["code"], pg["instruction"], pg["temperature"],
                                              pg["top_p"], pg["top_k"], pg["max_tokens"], pg["output"], pg["meter"],
                                              pg["last"], notice, tabs], show_progress="hidden")
    return {"table": table, "ids": ids, "count": count, "refresh": refresh}
