"""The pass@N tab: choose problems (HumanEval by id, range or search, or your own prompt and tests) and a
run configuration; the run is a server-side job (`app.jobs`) that this tab follows once a second from
the database — so a reload or another tab shows the same progress — with a grid of samples, the
pass@k table with its latency cost, a chart, and comparisons of stored runs."""
from __future__ import annotations

import html

import gradio as gr

from laneplay.app.checks import SandboxMissing, sandbox_status
from laneplay.app.context import AppContext, InputError, sampling
from laneplay.app.jobs import MAX_RUN_PROBLEMS, N_CHOICES, Busy, RunConfig, RunInputError
from laneplay.app.passn_view import chart_svg, compare_html, detail_box, grid_html, label, progress_html, table_html
from laneplay.evals.problems import ProblemError, humaneval, select, user_problem
from laneplay.storage import ValidationError

EXAMPLE_PROMPT = 'def running_max(xs: list[int]) -> list[int]:\n    """The maximum of xs[:i + 1] for each i."""\n'
EXAMPLE_TESTS = ("assert running_max([1, 3, 2, 5]) == [1, 3, 3, 5]\nassert running_max([]) == []\n"
                 "assert running_max([-2, -5]) == [-2, -2]\n")
SEARCH_LIMIT = 25
ACTIVE = ("queued", "running")


def message_html(text: str, elem_id: str = "passn-error", kind: str = "error") -> str:
    if not text:
        return f'<div id="{elem_id}" class="lp-error-none"></div>'
    cls = "lp-error" if kind == "error" else "lp-notice"
    return f'<div id="{elem_id}" class="{cls}" role="alert">{html.escape(text)}</div>'


def search_problems(query: str) -> list[tuple[str, str]]:
    """HumanEval problems whose id or prompt contains every word of `query` (case-insensitive)."""
    words = (query or "").lower().split()
    if not words:
        return []
    out = []
    for i, p in enumerate(humaneval()):
        hay = f"{p.task_id} {i} {p.prompt}".lower()
        if all(w in hay for w in words):
            first = next((ln.strip() for ln in p.prompt.splitlines() if ln.strip().startswith("def ")), p.entry_point)
            out.append((f"{p.task_id} · {first[:70]}", p.task_id))
            if len(out) >= SEARCH_LIMIT:
                break
    return out


def chosen_problems(source: str, spec: str, prompt: str, tests: str):
    """(problems, problem_set) from the tab's inputs; RunInputError with one sentence when unusable."""
    if source == "own":
        try:
            return [user_problem(prompt or "", tests or "", task_id="user/0")], "user"
        except ProblemError as e:
            raise RunInputError(f"Your problem cannot be used: {e}.") from None
    spec = (spec or "").strip()
    if not spec:
        raise RunInputError("Choose HumanEval problems: positions like 0-3 (end exclusive), 12, or ids like "
                            "HumanEval/31 — or search and add them.")
    if len(spec) > 2000:
        raise RunInputError("The problem list is too long.")
    try:
        problems = select("humaneval:" + spec)
    except ProblemError as e:
        raise RunInputError(f"Cannot read the problem list: {e}.") from None
    if len(problems) > MAX_RUN_PROBLEMS:
        raise RunInputError(f"{len(problems)} problems chosen; one run takes at most {MAX_RUN_PROBLEMS} "
                            "(use `laneplay eval` for the whole benchmark).")
    return problems, "humaneval"


def config_of(n, temperature, top_p, max_tokens, seed, mode) -> RunConfig:
    """The run's configuration from the tab's inputs, checked (the engine's bounds, pass@N's own)."""
    try:
        p = sampling(temperature, top_p, 0, max_tokens, 0 if seed in (None, "") else seed, None, n=n)
    except InputError as e:
        raise RunInputError(str(e)) from None
    config = RunConfig(n=p["n"], temperature=p["temperature"], top_p=p["top_p"], max_tokens=p["max_tokens"],
                       seed=p["seed"], mode=str(mode))
    config.validate()
    return config


def add_found(spec, picked):
    """The picked search matches appended to the problem list (each once)."""
    have = [s.strip() for s in (spec or "").split(",") if s.strip()]
    return ", ".join(have + [p for p in (picked or []) if p not in have])


class PassN:
    """The tab's handlers: start, cancel, follow, reopen and compare runs (jobs of `app.jobs`)."""

    def __init__(self, ctx: AppContext, make_share):
        self.ctx, self.make_share = ctx, make_share

    def run_list(self, owner):
        if owner is None:
            return gr.update(choices=[])
        return gr.update(choices=[(f"{label(r)} · {r['status']}", r["id"]) for r in
                                  self.ctx.store.list_comparisons(limit=100, owner=owner)])

    def render(self, run_id, owner, last_key=""):
        """(progress, grid, table, chart, key) of a run this owner may see; unchanged parts as updates."""
        run = self.ctx.store.get_comparison(run_id, owner=owner) if run_id else None
        if run is None:
            return progress_html(None), grid_html(None, ""), table_html(None), chart_svg([]), ""
        key = f"{run['id']}:{run['status']}:{len(run['results'])}:{len(run.get('timing') or {})}"
        prog = progress_html(run, self.ctx.jobs.live(run_id))
        if key == last_key:
            return prog, gr.update(), gr.update(), gr.update(), key
        return prog, grid_html(run, f"/api/runs/{run['id']}/sample"), table_html(run), chart_svg([run]), key

    async def start(self, src, spec, prompt, tests, n_v, t_v, p_v, mt_v, seed_v, mode_v, sid, request: gr.Request):
        ctx = self.ctx
        owner = ctx.owner_of(request)
        keep = (gr.update(),) * 6
        if owner is None:
            return (gr.update(), sid, message_html("This browser has no session cookie; reload the page.")) + keep
        try:
            config = config_of(n_v, t_v, p_v, mt_v, seed_v, mode_v)
            chosen, problem_set = chosen_problems(src, spec, prompt, tests)
            info = ctx.engine.info or {}
            ctx.jobs.admit(owner, ctx.address_of(request))  # before a session is made for the run
            if not sid or not ctx.store.owns(sid, owner):
                what = chosen[0].task_id if len(chosen) == 1 else f"{len(chosen)} {problem_set} problems"
                sid = ctx.store.create_session(
                    title=f"pass@{config.n}: {what}", owner=owner, code=prompt if src == "own" else "",
                    model=str(info.get("model") or "")[:200], device=str(info.get("device") or "")[:32],
                    world_size=max(1, min(int(info.get("world_size") or 1), 8)))
            run_id = await ctx.jobs.start(owner=owner, session_id=sid, problems=chosen, problem_set=problem_set,
                                          config=config, model=str(info.get("model") or ""),
                                          address=ctx.address_of(request))
        except (RunInputError, Busy, SandboxMissing, ValidationError) as e:
            return (gr.update(), sid, message_html(str(e))) + keep
        prog, g, t, c, key = self.render(run_id, owner)
        return run_id, sid, message_html(""), prog, g, t, c, key, self.run_list(owner)

    def cancel(self, run_id, request: gr.Request):
        if run_id and self.ctx.jobs.cancel(run_id, self.ctx.owner_of(request)):
            return message_html("Cancelling: the run stops after the request in flight; what finished is kept.",
                                kind="notice")
        return message_html("No run of yours is going here.", kind="notice")

    def share(self, sid, request: gr.Request):
        """A read-only link to this session as it is now, its runs included (the Playground's Share)."""
        link, _ = self.make_share(sid, request)
        if link:
            return link, message_html("")
        return "", message_html("No link made: start a run first (a link freezes the session as it is now), or "
                                "this session has reached its limit of share links.")

    def poll(self, run_id, last_key, request: gr.Request):
        """Once a second: the progress; the rest only when the stored run changed; the list of runs when
        the run has just ended (its status shows there)."""
        if not run_id:
            return (gr.update(),) * 4 + (last_key, gr.update())
        owner = self.ctx.owner_of(request)
        out = self.render(run_id, owner, last_key)
        ended = out[-1] != last_key and out[-1].split(":")[1] not in ACTIVE if out[-1] else False
        return out + (self.run_list(owner) if ended else gr.update(),)

    def open_run(self, chosen, request: gr.Request):
        owner = self.ctx.owner_of(request)
        chosen = [c for c in (chosen or []) if self.ctx.store.owns_comparison(c, owner)]
        if len(chosen) != 1:
            return (gr.update(), message_html("Pick exactly one of your runs to open it.", kind="notice")) + \
                (gr.update(),) * 5
        prog, g, t, c, key = self.render(chosen[0], owner)
        return chosen[0], message_html(""), prog, g, t, c, key

    def compare(self, chosen, request: gr.Request):
        owner = self.ctx.owner_of(request)
        picked = [self.ctx.store.get_comparison(c, owner=owner) for c in (chosen or [])]
        picked = [r for r in picked if r is not None]
        if len(picked) < 2:
            return message_html("Pick two or more runs to compare.", kind="notice"), gr.update(), gr.update()
        return message_html(""), compare_html(picked), chart_svg(picked, "passn-compare-chart")

    def on_load(self, request: gr.Request):
        """A reloaded page shows the browser's run that is still going (its progress is in the database)."""
        owner = self.ctx.owner_of(request)
        active = next((r["id"] for r in self.ctx.store.list_comparisons(limit=20, owner=owner)
                       if r["status"] in ACTIVE), None) if owner else None
        prog, g, t, c, key = self.render(active, owner)
        return active, prog, g, t, c, key, self.run_list(owner)

    def refresh_runs(self, request: gr.Request):
        return self.run_list(self.ctx.owner_of(request))


def _problems_ui(ui: dict) -> None:
    ui["source"] = gr.Radio([("HumanEval", "humaneval"), ("My own problem", "own")], value="humaneval",
                            label="Problems", elem_id="passn-source", interactive=True)
    with gr.Group(visible=True) as ui["he_box"]:
        ui["problems"] = gr.Textbox(value="0-2", label="HumanEval problems: positions, ranges A-B (end exclusive), "
                                    "ids", placeholder="0-5, 12, HumanEval/31", elem_id="passn-problems",
                                    interactive=True, max_lines=2)
        with gr.Row(equal_height=True):
            ui["search"] = gr.Textbox(label="Search by id or text", placeholder="e.g. palindrome", scale=3,
                                      elem_id="passn-search", interactive=True, max_lines=1)
            ui["found"] = gr.Dropdown(choices=[], multiselect=True, label="Matches", scale=5, elem_id="passn-found",
                                      interactive=True)
            ui["add"] = gr.Button("Add to the list", elem_id="passn-add", scale=1, min_width=100)
    with gr.Group(visible=False) as ui["own_box"]:
        ui["own_prompt"] = gr.Code(EXAMPLE_PROMPT, language="python", label="Prompt: a function stub (or an "
                                   "instruction that names the function)", elem_id="passn-prompt", lines=5,
                                   interactive=True)
        ui["own_tests"] = gr.Code(EXAMPLE_TESTS, language="python", label="Tests: asserts that call the function",
                                  elem_id="passn-tests", lines=4, interactive=True)


def _config_ui(ui: dict, ok: bool) -> None:
    ui["n"] = gr.Radio([str(k) for k in N_CHOICES], value="4", label="N: samples per problem", elem_id="passn-n",
                       interactive=True)
    ui["temperature"] = gr.Slider(0.05, 2.0, value=0.8, step=0.05, label="Temperature of the samples (greedy is 0)",
                                  elem_id="passn-temperature", interactive=True)
    ui["top_p"] = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top-p", elem_id="passn-top-p", interactive=True)
    with gr.Row():
        ui["max_tokens"] = gr.Number(value=256, precision=0, label="Max tokens", elem_id="passn-max-tokens",
                                     interactive=True, min_width=80)
        ui["seed"] = gr.Number(value=0, precision=0, label="Seed (sample i: seed + i)", elem_id="passn-seed",
                               interactive=True, min_width=80)
    ui["mode"] = gr.Radio([("Chat: code from the answer", "instruct"), ("Completion of the prompt", "base")],
                          value="instruct", label="Prompting", elem_id="passn-mode", interactive=True)
    with gr.Row():
        ui["run"] = gr.Button("Run", variant="primary", elem_id="passn-run", interactive=ok)
        ui["cancel"] = gr.Button("Cancel", variant="stop", elem_id="passn-cancel")
        ui["share"] = gr.Button("Share", elem_id="passn-share")


def _results_ui(ui: dict) -> None:
    ui["error"] = gr.HTML(message_html(""), elem_id="passn-error-box")
    ui["share_box"] = gr.HTML("", elem_id="passn-share-box")
    ui["progress"] = gr.HTML(progress_html(None), elem_id="passn-progress-box")
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            ui["grid"] = gr.HTML(grid_html(None, ""), elem_id="passn-grid-box")
            gr.HTML(detail_box(), elem_id="passn-detail-box")
        with gr.Column(scale=5):
            ui["table"] = gr.HTML(table_html(None), elem_id="passn-table-box")
            ui["chart"] = gr.HTML(chart_svg([]), elem_id="passn-chart-box")
    with gr.Accordion("Your runs: reopen one, or compare two or more", open=True):
        with gr.Row(equal_height=True):
            ui["runs"] = gr.Dropdown(choices=[], multiselect=True, label="Runs of this browser", elem_id="passn-runs",
                                     scale=6, interactive=True)
            ui["open"] = gr.Button("Open", elem_id="passn-open", scale=1, min_width=80)
            ui["compare"] = gr.Button("Compare", elem_id="passn-compare", scale=1, min_width=90)
        ui["compare_table"] = gr.HTML(compare_html([]), elem_id="passn-compare-box")
        ui["compare_chart"] = gr.HTML(chart_svg([], "passn-compare-chart"), elem_id="passn-compare-chart-box")


def build(ctx: AppContext, session_id: gr.State, pg: dict) -> dict:
    tab, ui = PassN(ctx, pg["make_share"]), {}
    ok, why = sandbox_status()
    gr.Markdown("Is sampling N times worth its latency? Each problem gets a greedy answer and **N samples as one "
                "batched request**; every answer runs against the problem's tests in the sandbox. The run is a job on "
                "the server: reload or close the page and it goes on; reopen it here or from History.")
    gr.HTML("" if ok else message_html(f"The sandbox is unavailable, so this tab runs nothing: {why}",
                                       "passn-sandbox"))
    with gr.Row(equal_height=False):
        with gr.Column(scale=6):
            _problems_ui(ui)
        with gr.Column(scale=5):
            _config_ui(ui, ok)
    _results_ui(ui)
    current = gr.State(None)  # the run shown
    shown = gr.State("")  # what the grid/table/chart show now (re-rendered only when it changes)
    views = [ui["progress"], ui["grid"], ui["table"], ui["chart"], shown]
    quiet = {"show_progress": "hidden"}
    ui["source"].change(lambda s: (gr.update(visible=s != "own"), gr.update(visible=s == "own")), [ui["source"]],
                        [ui["he_box"], ui["own_box"]], **quiet)
    ui["search"].change(lambda q: gr.update(choices=search_problems(q), value=[]), [ui["search"]], [ui["found"]],
                        **quiet)
    ui["add"].click(add_found, [ui["problems"], ui["found"]], [ui["problems"]], **quiet)
    ui["run"].click(tab.start, [ui[k] for k in ("source", "problems", "own_prompt", "own_tests", "n", "temperature",
                                                "top_p", "max_tokens", "seed", "mode")] + [session_id],
                    [current, session_id, ui["error"], *views, ui["runs"]], api_name="passn_run", **quiet)
    ui["cancel"].click(tab.cancel, [current], [ui["error"]], api_name="passn_cancel", **quiet)
    ui["share"].click(tab.share, [session_id], [ui["share_box"], ui["error"]], **quiet)
    ui["open"].click(tab.open_run, [ui["runs"]], [current, ui["error"], *views], **quiet)
    ui["compare"].click(tab.compare, [ui["runs"]], [ui["error"], ui["compare_table"], ui["compare_chart"]], **quiet)
    gr.Timer(1.0).tick(tab.poll, [current, shown], [*views, ui["runs"]], concurrency_limit=None, **quiet)
    return {"current": current, "runs": ui["runs"], "run_list": tab.run_list, "refresh_runs": tab.refresh_runs,
            "render": tab.render, "on_load": tab.on_load, "load_outputs": [current, *views, ui["runs"]],
            "open_outputs": [current, *views]}
