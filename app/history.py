"""The History tab: this browser's sessions only (by its owner cookie); reopen, rename, delete, revoke links."""
from __future__ import annotations

import html
import itertools
from dataclasses import asdict

import gradio as gr

from laneplay.app.context import AppContext
from laneplay.app.meter import MeterData, of_stored, render
from laneplay.storage import NotFound, ValidationError

COLUMNS = ["Title", "Model", "Updated (UTC)", "Best tokens/s", "Generations", "Share links"]
RUN_COLUMNS = ["Run", "Status", "Problems", "N", "T", "pass@1", "best pass@k", "greedy pass@1", "Started (UTC)"]


def run_rows(ctx: AppContext, owner: str | None) -> tuple[list[list], list[str]]:
    """This browser's pass@N runs (any session of its own), newest first."""
    if owner is None:
        return [], []
    runs = ctx.store.list_comparisons(limit=200, owner=owner)

    def num(x):
        return None if x is None else round(x, 3)

    table = []
    for r in runs:
        passk = {p["k"]: p["value"] for p in r["passk"]}
        best = max(passk.items()) if passk else None
        table.append([r["problem_set"], r["status"], r["problems"], r["n"], r["temperature"], num(passk.get(1)),
                      f"pass@{best[0]} = {best[1]:.3f}" if best else None, num(r["greedy_pass1"]),
                      (r["created_at"] or "")[:19].replace("T", " ")])
    return table, [r["id"] for r in runs]


def rows(ctx: AppContext, owner: str | None) -> tuple[list[list], list[str]]:
    if owner is None:
        return [], []
    sessions = ctx.store.list_sessions(limit=200, owner=owner)
    table = [[s["title"] or "Untitled session", s["model"] or "–", (s["updated_at"] or "")[:19].replace("T", " "),
              round(s["best_tokens_per_second"], 1) if s["best_tokens_per_second"] else None,
              s["generations"], s["share_links"]] for s in sessions]
    return table, [s["id"] for s in sessions]


def links_view(ctx: AppContext, sid: str, owner: str | None) -> tuple[str, dict]:
    """The live links of `owner`'s session (list_shares answers nobody else): the list's HTML, and the
    revoke dropdown's update (label, key) with the newest picked."""
    links = ctx.store.list_shares(sid, owner=owner)
    choices = [(f"{x['link'][:8]} ({(x['created_at'] or '')[:19].replace('T', ' ')})", x["link"]) for x in links]
    return links_html(links), gr.update(choices=choices, value=choices[0][1] if choices else None)


def links_html(links: list[dict]) -> str:
    if not links:
        return "<p class='lp-muted'>No live share links for this session.</p>"
    items = "".join(f"<li>link <code>{html.escape(x['link'][:8])}</code> created "
                    f"{html.escape((x['created_at'] or '')[:19].replace('T', ' '))} UTC</li>" for x in links)
    return f"<ul class='lp-links'>{items}</ul>"


# A plain form (no script: it works under the page's CSP): the server deletes everything of this browser
# and clears its cookie, then reloads the page as a new browser.
FORGET_HTML = ("<details class='lp-forget' id='history-forget'><summary>Forget this browser…</summary>"
               "<p>Deletes every session, output, pass@N run and share link of this browser from the server, and "
               "its cookie. This cannot be undone.</p><form method='post' action='/api/forget'>"
               "<button type='submit' id='history-forget-confirm' class='lp-danger'>Delete all and forget this "
               "browser</button></form></details>")


def stored_meter(session: dict, note: str) -> dict | None:
    """The meter record of a session's latest generation (None if it has none)."""
    gens = session["generations"]
    if not gens:
        return None
    return asdict(of_stored(gens[-1], note))


def _pick(ids_now, evt: gr.SelectData):
    """The id of the row a click selected (None: no row)."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    return ids_now[row] if row is not None and row < len(ids_now) else None


class History:
    """The tab's handlers: every one answers the browser's own sessions and runs only."""

    def __init__(self, ctx: AppContext, render_run):
        self.ctx, self.render_run = ctx, render_run
        self.refreshes = itertools.count(1)

    def refresh(self, request: gr.Request):
        owner = self.ctx.owner_of(request)
        table_rows, session_ids = rows(self.ctx, owner)
        n = len(session_ids)
        summary = (f'<span id="history-count" data-count="{n}" data-seq="{next(self.refreshes)}">'
                   f'{n} session{"s" if n != 1 else ""}</span>')
        return (table_rows, session_ids, summary, *run_rows(self.ctx, owner))

    def open_run(self, run_id, request: gr.Request):
        owner = self.ctx.owner_of(request)
        if not run_id or not self.ctx.store.owns_comparison(run_id, owner):
            return (gr.update(),) * 6 + ("Select one of your runs first.", gr.update())
        return (run_id, *self.render_run(run_id, owner)) + ("", gr.Tabs(selected="passn"))

    def pick(self, session_ids, evt: gr.SelectData, request: gr.Request):
        sid = _pick(session_ids, evt)
        owner = self.ctx.owner_of(request)
        s = self.ctx.store.get_session(sid, owner=owner) if sid else None
        if s is None:
            return None, "", "", gr.update(choices=[], value=None)
        return sid, s["title"], *links_view(self.ctx, sid, owner)

    def rename(self, sid, new_title, request: gr.Request):
        owner = self.ctx.owner_of(request)
        if not sid or not self.ctx.store.owns(sid, owner):
            return "Select one of your sessions first."
        try:
            self.ctx.store.update_session(sid, title=(new_title or "").strip() or "Untitled session", owner=owner)
        except (ValidationError, NotFound) as e:
            return f"Not renamed: {e}"
        return "Renamed."

    def delete(self, sid, request: gr.Request):
        if not sid or not self.ctx.store.delete_session(sid, owner=self.ctx.owner_of(request)):
            return "Select one of your sessions first.", None
        return "Deleted (its share links are gone too).", None

    def revoke(self, sid, link, request: gr.Request):
        owner = self.ctx.owner_of(request)
        if not sid or not self.ctx.store.owns(sid, owner) or not link:  # nothing of anyone else's in the answer
            return "Select one of your sessions and one of its links first.", "", gr.update(choices=[], value=None)
        ok = self.ctx.store.revoke_link(sid, link, owner=owner)
        return ("Revoked: the link now shows “does not exist or was revoked”." if ok else "That link was already gone."), \
            *links_view(self.ctx, sid, owner)

    def open_session(self, sid, request: gr.Request):
        s = self.ctx.store.get_session(sid, owner=self.ctx.owner_of(request)) if sid else None
        if s is None:
            return (gr.update(),) * 14 + ("Select one of your sessions first.", gr.update())
        p = s["params"] or {}
        record = stored_meter(s, "reopened")
        return (sid, s["code"], s["instruction"], s["mode"] or gr.update(),  # (older sessions: the page's mode)
                p.get("temperature", 0.0), p.get("top_p", 1.0), p.get("top_k", 0), p.get("max_tokens", 256),
                p.get("frequency_penalty", 0.0), p.get("presence_penalty", 0.0),
                p.get("repetition_penalty", 1.0), s["generations"][-1]["text"] if s["generations"] else "",
                render(MeterData(**record)) if record else gr.update(), record or {}, "",
                gr.Tabs(selected="playground"))


def build(ctx: AppContext, session_id: gr.State, pg: dict, tabs: gr.Tabs, pn: dict) -> dict:
    tab = History(ctx, pn["render"])
    gr.Markdown("Sessions of this browser (kept in the app's database; other browsers never see them).")
    count = gr.HTML('<span id="history-count" data-count="" data-seq="0"></span>', elem_id="history-count-box")
    ids, selected = gr.State([]), gr.State(None)
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
    gr.Markdown("pass@N runs of this browser (they are part of their session's share links).")
    run_ids, selected_run = gr.State([]), gr.State(None)
    runs_table = gr.Dataframe(headers=RUN_COLUMNS, value=[], interactive=False, elem_id="history-runs", wrap=True)
    open_run_btn = gr.Button("Open run in pass@N", elem_id="history-open-run")
    gr.HTML(FORGET_HTML, elem_id="history-forget-box")

    quiet = {"show_progress": "hidden"}  # no progress timers inside the notice or the table
    reload = (tab.refresh, None, [table, ids, count, runs_table, run_ids])
    runs_table.select(_pick, [run_ids], [selected_run], **quiet)
    open_run_btn.click(tab.open_run, [selected_run], pn["open_outputs"] + [notice, tabs], **quiet)
    table.select(tab.pick, [ids], [selected, title, links, link_choice], **quiet)
    rename_btn.click(tab.rename, [selected, title], [notice], **quiet).then(*reload, **quiet)
    delete_btn.click(tab.delete, [selected], [notice, selected], **quiet).then(*reload, **quiet)
    revoke_btn.click(tab.revoke, [selected, link_choice], [notice, links, link_choice], **quiet).then(*reload, **quiet)
    open_btn.click(tab.open_session, [selected], [session_id, pg["code"], pg["instruction"], pg["mode"],
                                                  pg["temperature"], pg["top_p"], pg["top_k"], pg["max_tokens"],
                                                  pg["frequency_penalty"], pg["presence_penalty"],
                                                  pg["repetition_penalty"], pg["output"], pg["meter"], pg["last"],
                                                  notice, tabs], **quiet)
    return {"table": table, "ids": ids, "count": count, "refresh": tab.refresh,
            "outputs": [table, ids, count, runs_table, run_ids]}
