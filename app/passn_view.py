"""HTML for pass@N runs, shared by the pass@N tab and the read-only share page: the progress line, the
grid of samples, the pass@k table with its latency cost, the chart (inline SVG, no library), and the
comparison of several runs. Everything is computed from the stored run (`Store.get_comparison`), so a
reopened, interrupted or shared run reads exactly like a live one."""
from __future__ import annotations

import html
import math
from datetime import datetime

from laneplay.app.jobs import cost_per_k, summarize
from laneplay.evals.passk import KS

esc = html.escape
COLOURS = ("#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed", "#0891b2")
STATE_WORDS = {"queued": "Queued", "running": "Running", "done": "Done", "cancelled": "Cancelled",
               "interrupted": "Interrupted", "error": "Failed"}


def _seconds(a: str | None, b: str | None) -> float | None:
    try:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
    except (TypeError, ValueError):
        return None


def _clock(s: float | None) -> str:
    if s is None:
        return "–"
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def label(run: dict) -> str:
    """A run in a few words: what, how many, how sampled, when."""
    probs = run.get("problem_ids") or []
    what = ", ".join(probs) if len(probs) <= 3 else f"{probs[0]} … {probs[-1]} ({len(probs)} problems)"
    when = (run.get("created_at") or "")[:19].replace("T", " ")
    return f"{what} · N={run['n']} · T={run['temperature']:g} · {run.get('model') or 'engine'} · {when}"


def progress_html(run: dict | None, live: dict | None = None, elem_id: str = "passn-progress") -> str:
    """The run's state with `data-state`, `data-done`/`data-total` (problems fully checked / chosen),
    `data-checked`/`data-samples` (checked samples, greedy included), `data-elapsed-s`, `data-eta-s`."""
    if run is None:
        return (f'<div id="{elem_id}" class="lp-progress" data-state="none" data-done="0" data-total="0" '
                f'data-checked="0" data-samples="0">No run yet: choose problems and press Run.</div>')
    per_problem = run["n"] + (1 if run["greedy"] else 0)
    total_samples = per_problem * len(run["problem_ids"])
    counts: dict[str, int] = {}
    for r in run["results"]:
        counts[r["problem_id"]] = counts.get(r["problem_id"], 0) + 1
    checked = sum(counts.values())
    done = sum(c == per_problem for c in counts.values())
    state = run["status"]
    if live is not None:
        elapsed = live["elapsed_s"]
    else:
        elapsed = _seconds(run.get("created_at"), run.get("finished_at"))
    eta = None
    if state == "running" and checked and elapsed:
        eta = elapsed / checked * (total_samples - checked)
    bar = 100.0 * checked / total_samples if total_samples else 0.0
    words = [f"<b>{STATE_WORDS.get(state, state)}</b>", f"{done}/{len(run['problem_ids'])} problems",
             f"{checked}/{total_samples} samples checked", f"{_clock(elapsed)} elapsed"]
    if eta is not None:
        words.append(f"ETA {_clock(eta)}")
    if state == "queued" and live and live.get("queue_position"):
        words.append(f"position {live['queue_position']} in the queue: another run is using the engine")
    elif state == "running" and live:
        words.append(esc(live["phase"]))
    elif state == "interrupted":
        words.append("the server stopped during the run; below is what finished")
    elif state == "cancelled":
        words.append("cancelled; below is what finished")
    elif state == "error":
        words.append(f"error: {esc(run.get('error') or 'unknown')}")
    attrs = (f'id="{elem_id}" class="lp-progress lp-run-{esc(state)}" data-state="{esc(state)}" data-done="{done}" '
             f'data-total="{len(run["problem_ids"])}" data-checked="{checked}" data-samples="{total_samples}" '
             f'data-elapsed-s="{(elapsed or 0):.1f}" data-eta-s="{"" if eta is None else f"{eta:.0f}"}" '
             f'data-run="{esc(run.get("id", ""))}"')
    return (f'<div {attrs}><div class="lp-progress-text">{" · ".join(words)}</div>'
            f'<div class="lp-bar"><div style="width:{bar:.1f}%"></div></div></div>')


def grid_html(run: dict | None, src: str, elem_id: str = "passn-grid", detail_id: str = "passn-detail") -> str:
    """One row per problem: the greedy cell, then the N samples, coloured by outcome (grey: not yet);
    clicking a cell shows its code and its failing assert or traceback (static/passn.js fetches it
    from `src`)."""
    if run is None:
        return f'<div id="{elem_id}" class="lp-grid" data-cells="0"></div>'
    by_key = {(r["problem_id"], r["greedy"], r["sample_index"]): r for r in run["results"]}
    rows = []
    for pid in run["problem_ids"]:
        cells = []
        sides = ([(True, 0)] if run["greedy"] else []) + [(False, i) for i in range(run["n"])]
        for greedy, i in sides:
            r = by_key.get((pid, greedy, i))
            status = r["status"] if r else "pending"
            name = "greedy" if greedy else f"sample {i}"
            tip = f"{pid} {name}: {status}"
            if r and r.get("error"):
                tip += " — " + r["error"].strip().splitlines()[-1][:120]
            focus = ' role="button" tabindex="0"' if r else ""
            cells.append(f'<span class="lp-sample lp-s-{status}{" lp-greedy" if greedy else ""}"{focus} '
                         f'data-problem="{esc(pid)}" data-greedy="{int(greedy)}" data-index="{i}" '
                         f'data-status="{status}" title="{esc(tip)}">{"G" if greedy else i}</span>')
        rows.append(f'<div class="lp-grid-row"><span class="lp-grid-id">{esc(pid)}</span>{"".join(cells)}</div>')
    legend = "".join(f'<span class="lp-sample lp-s-{s}">{s}</span>'
                     for s in ("pass", "fail", "error", "timeout", "memory", "pending"))
    return (f'<div id="{elem_id}" class="lp-grid" data-cells="{len(run["results"])}" data-src="{esc(src)}" '
            f'data-detail="{esc(detail_id)}"><div class="lp-grid-legend">{legend} · G = greedy · click a cell for '
            f'its code</div>{"".join(rows)}</div>')


def detail_box(elem_id: str = "passn-detail") -> str:
    """Where a clicked cell's code and error appear (filled by static/passn.js, never by the server)."""
    return f'<div id="{elem_id}" class="lp-grid-detail" data-state="empty"></div>'


def table_html(run: dict | None, elem_id: str = "passn-table") -> str:
    """pass@k (unbiased, k <= N) next to greedy pass@1, and the latency cost of k samples."""
    if run is None:
        return f'<div id="{elem_id}" class="lp-passk" data-rows="0"></div>'
    s = summarize(run)
    costs = {c["k"]: c for c in cost_per_k(run)}
    if not s["passk"]:
        return (f'<div id="{elem_id}" class="lp-passk" data-rows="0"><p class="lp-muted">pass@k appears once a '
                f'problem has all its samples checked.</p></div>')
    greedy = "–" if s["greedy_pass1"] is None else f"{s['greedy_pass1']:.3f}"
    greedy_ms = None
    timing = [t for t in (run.get("timing") or {}).values() if "greedy_ms" in t]
    if timing:
        greedy_ms = sum(t["greedy_ms"] for t in timing) / len(timing)
    body = []
    for k, value in sorted(s["passk"].items()):
        c = costs.get(k)
        cost = "–" if c is None else f"{c['ms'] / 1000:.2f} s"
        ratio = "–" if c is None or c["vs_greedy"] is None else f"×{c['vs_greedy']:.2f}"
        how = "" if c is None else esc(c["how"])
        body.append(f'<tr data-k="{k}" data-passk="{value:.4f}"><td>{k}</td><td><b>{value:.3f}</b></td>'
                    f'<td>{greedy}</td><td title="{how}">{cost}</td><td>{ratio}</td></tr>')
    total = len(run["problem_ids"])
    scope = (f"over {s['problems_complete']} of {total} problems so far" if s["problems_complete"] < total
             else f"over {total} problem{'s' if total != 1 else ''}")
    note = (f"Unbiased pass@k from N={run['n']} samples per problem at T={run['temperature']:g}, {scope}. "
            f"Greedy pass@1 over {s['greedy_done']} greedy answers"
            + (f" (one greedy call: {greedy_ms / 1000:.2f} s per problem)" if greedy_ms else "") +
            ". Time of a k-sample batch per problem: measured for k=N, from the decode step time measured at "
            "batch k otherwise.")
    g1 = "" if s["greedy_pass1"] is None else f"{s['greedy_pass1']:.4f}"
    return (f'<div id="{elem_id}" class="lp-passk" data-rows="{len(body)}" data-greedy-pass1="{g1}">'
            f'<table><thead><tr><th>k</th><th>pass@k</th><th>greedy pass@1</th><th>k-sample batch</th>'
            f'<th>vs greedy call</th></tr></thead><tbody>{"".join(body)}</tbody></table>'
            f'<p class="lp-muted">{note}</p></div>')


def chart_svg(runs: list[dict], elem_id: str = "passn-chart") -> str:
    """pass@k against k (log2 axis) for one or more runs, each with its greedy pass@1 as a dashed line."""
    series = [(r, summarize(r)) for r in runs if r is not None]
    series = [(r, s) for r, s in series if s["passk"] or s["greedy_pass1"] is not None]
    if not series:
        return f'<div id="{elem_id}" class="lp-chart" data-series="0"></div>'
    w, h, left, right, top, bottom = 560, 260, 46, 16, 14, 34
    kmax = max(max(s["passk"], default=1) for _, s in series)
    kmax = max(kmax, 2)
    xs = [k for k in KS if k <= kmax]

    def x(k):
        return left + (math.log2(k) / math.log2(kmax)) * (w - left - right)

    def y(v):
        return top + (1 - v) * (h - top - bottom)

    parts = [f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" class="lp-plot"/>']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="lp-gridline"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for k in xs:
        parts.append(f'<text x="{x(k):.1f}" y="{h - bottom + 16}" text-anchor="middle">{k}</text>')
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 4}" text-anchor="middle">k (samples drawn)</text>')
    legend = []
    for i, (r, s) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        pts = sorted(s["passk"].items())
        if pts:
            path = " ".join(f"{'M' if j == 0 else 'L'}{x(k):.1f} {y(v):.1f}" for j, (k, v) in enumerate(pts))
            parts.append(f'<path d="{path}" stroke="{colour}" class="lp-series" data-run="{esc(r.get("id", ""))}"/>')
            parts += [f'<circle cx="{x(k):.1f}" cy="{y(v):.1f}" r="3.5" fill="{colour}"><title>pass@{k} = '
                      f'{v:.3f}</title></circle>' for k, v in pts]
        if s["greedy_pass1"] is not None:
            gy = y(s["greedy_pass1"])
            parts.append(f'<line x1="{left}" x2="{w - right}" y1="{gy:.1f}" y2="{gy:.1f}" stroke="{colour}" '
                         f'class="lp-greedy-line"><title>greedy pass@1 = {s["greedy_pass1"]:.3f}</title></line>')
        legend.append(f'<span class="lp-legend"><i style="background:{colour}"></i>{esc(label(r))}</span>')
    svg = (f'<svg viewBox="0 0 {w} {h}" role="img" aria-label="pass@k against k">{"".join(parts)}</svg>')
    return (f'<div id="{elem_id}" class="lp-chart" data-series="{len(series)}">{svg}<div class="lp-legends">'
            f'{"".join(legend)} <span class="lp-muted">solid: pass@k · dashed: greedy pass@1</span></div></div>')


def compare_html(runs: list[dict], elem_id: str = "passn-compare-table") -> str:
    """Several runs side by side: pass@k per k, greedy pass@1 and the time of the N-sample batch."""
    if not runs:
        return f'<div id="{elem_id}" class="lp-compare" data-runs="0"></div>'
    sums = [summarize(r) for r in runs]
    costs = [{c["k"]: c for c in cost_per_k(r)} for r in runs]
    ks = sorted({k for s in sums for k in s["passk"]})
    head = "".join(f'<th data-run="{esc(r.get("id", ""))}">{esc(label(r))}<br><span class="lp-muted">'
                   f'{esc(STATE_WORDS.get(r["status"], r["status"]))}</span></th>' for r in runs)
    rows = []
    for k in ks:
        cells = "".join(f'<td>{s["passk"][k]:.3f}<span class="lp-muted"> · '
                        f'{c[k]["ms"] / 1000:.2f} s</span></td>' if k in s["passk"] and k in c else
                        (f'<td>{s["passk"][k]:.3f}</td>' if k in s["passk"] else "<td>–</td>")
                        for s, c in zip(sums, costs))
        rows.append(f'<tr data-k="{k}"><th>pass@{k}</th>{cells}</tr>')
    greedy = "".join("<td>–</td>" if s["greedy_pass1"] is None else f"<td>{s['greedy_pass1']:.3f}</td>"
                     for s in sums)
    rows.append(f"<tr><th>greedy pass@1</th>{greedy}</tr>")
    return (f'<div id="{elem_id}" class="lp-compare" data-runs="{len(runs)}"><table><thead><tr><th></th>{head}'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table><p class="lp-muted">Each cell: pass@k · time of a '
            f'k-sample batch per problem.</p></div>')
