"""The pass@N tab in a real browser against a real `laneplay serve`: a run on two HumanEval problems that
goes on across a page reload, its grid, table and chart; cancel; a comparison of two runs; the run in a
share link, read-only, in a fresh browser context."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .conftest import VIEWPORT, Recorder, open_share, screenshot

pytestmark = pytest.mark.slow
MAX_TOKENS = "64"  # short answers: the run's mechanics are under test here, not the model


def progress(page) -> dict:
    return page.eval_on_selector("#passn-progress", "p => ({state: p.dataset.state, done: Number(p.dataset.done), "
                                                    "total: Number(p.dataset.total), checked: "
                                                    "Number(p.dataset.checked), run: p.dataset.run || ''})")


def wait_progress(page, ok, what: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = progress(page)
        if ok(p):
            return p
        time.sleep(0.1)
    raise AssertionError(f"{what}: the progress is {progress(page)}; {page.inner_text('#passn-error')!r}")


def fill(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(value)
    box.press("Tab")


def start_run(page, problems: str, n: str, temperature: str = "0.8") -> None:
    page.get_by_role("tab", name="pass@N").click()
    page.wait_for_selector("#passn-problems")
    fill(page, "passn-problems", problems)
    page.locator("#passn-n").get_by_text(n, exact=True).click()
    fill(page, "passn-temperature", temperature)
    fill(page, "passn-max-tokens", MAX_TOKENS)
    time.sleep(0.3)  # the last value reaches the server before the click
    page.click("#passn-run")


@pytest.fixture(scope="module")
def owner(browser, server):
    ctx = browser.new_context(viewport={**VIEWPORT, "height": 1200})
    rec = Recorder()
    rec.attach(ctx)
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    server.wait_ready()
    yield ctx, rec, page
    ctx.close()
    rec.check()


def test_a_run_continues_across_a_reload_and_ends_with_table_and_chart(server, owner):
    _, _, page = owner
    start_run(page, "0-2", "2")
    first = wait_progress(page, lambda p: p["state"] in ("queued", "running") and p["run"], "the run did not start")
    assert first["total"] == 2
    mid = wait_progress(page, lambda p: p["checked"] >= 1, "no sample was checked")
    screenshot(page, "passn-running")
    page.reload()  # the run is a job on the server: the reloaded page finds it and follows it
    page.wait_for_selector("#meter")
    page.get_by_role("tab", name="pass@N").click()
    again = wait_progress(page, lambda p: p["run"] == first["run"], "the reloaded page did not show the run", 30)
    assert again["checked"] >= mid["checked"]
    done = wait_progress(page, lambda p: p["state"] not in ("queued", "running"), "the run did not end")
    assert done["state"] == "done" and done["done"] == 2 and done["checked"] == 2 * 3
    page.wait_for_function("() => document.querySelectorAll('#passn-table tr[data-k]').length === 2")
    ks = page.eval_on_selector_all("#passn-table tr[data-k]", "rows => rows.map(r => [Number(r.dataset.k), "
                                                               "Number(r.dataset.passk)])")
    assert [k for k, _ in ks] == [1, 2] and all(0 <= v <= 1 for _, v in ks)
    assert ks[0][1] <= ks[1][1]  # pass@k never falls with k
    assert page.get_attribute("#passn-chart", "data-series") == "1"
    assert page.locator("#passn-chart svg path.lp-series").count() == 1
    cells = page.locator("#passn-grid .lp-sample[data-problem]")
    assert cells.count() == 6
    statuses = set(cells.evaluate_all("cs => cs.map(c => c.dataset.status)"))
    assert statuses <= {"pass", "fail", "error", "timeout", "memory"}
    cells.nth(1).click()  # a sample: its code (and the failing assert or traceback, if any)
    page.wait_for_function("() => !['empty', 'loading'].includes(document.querySelector('#passn-detail')"
                           ".dataset.state)")
    assert page.get_attribute("#passn-detail", "data-state") in statuses
    assert "HumanEval/" in page.inner_text("#passn-detail")
    screenshot(page, "passn-done")


def test_cancel_stops_a_run_and_keeps_what_finished(server, owner):
    _, _, page = owner
    start_run(page, "3-6", "4")
    started = wait_progress(page, lambda p: p["state"] == "running" and p["run"], "the run did not start")
    page.click("#passn-cancel")
    end = wait_progress(page, lambda p: p["state"] not in ("queued", "running"), "the cancel did not land", 60)
    assert end["state"] == "cancelled" and end["run"] == started["run"] and end["done"] < 3
    time.sleep(2.0)
    assert progress(page)["checked"] == end["checked"]  # nothing arrives after a cancel


def test_two_runs_side_by_side_in_one_table_and_one_chart(server, owner):
    _, _, page = owner
    start_run(page, "HumanEval/2", "1", temperature="0.2")
    wait_progress(page, lambda p: p["state"] == "done" and p["total"] == 1, "the second run did not finish")
    runs = page.locator("#passn-runs input")
    time.sleep(1.5)  # the list of runs is refreshed as a run ends
    for name in ("HumanEval/0, HumanEval/1 · N=2", "HumanEval/2 · N=1"):  # pick by typing: the list filters
        runs.click()
        runs.fill(name)
        time.sleep(0.5)
        page.keyboard.press("ArrowDown")
        page.keyboard.press("Enter")
        page.keyboard.press("Escape")
    picked = page.inner_text("#passn-runs")
    assert "HumanEval/0, HumanEval/1 · N=2" in picked and "HumanEval/2 · N=1" in picked, picked
    page.click("#passn-compare")
    page.wait_for_function("() => document.querySelector('#passn-compare-table').dataset.runs === '2'")
    assert page.get_attribute("#passn-compare-chart", "data-series") == "2"
    assert page.locator("#passn-compare-table tr[data-k]").count() == 2  # k = 1, 2 (the N=1 run has k = 1 only)


def test_a_share_link_shows_the_runs_read_only_in_a_fresh_browser(server, owner, new_context):
    _, _, page = owner
    _, viewer = open_share(page, new_context, "#passn-share")
    assert viewer.locator("#passn-table tr[data-k]").count() >= 1 and viewer.locator("#passn-chart svg").count()
    assert viewer.get_attribute("#passn-progress", "data-state") == "done"
    assert viewer.locator("textarea, input, [contenteditable=true]").count() == 0  # read-only
    viewer.locator("#passn-grid .lp-sample[data-problem]").first.click()
    viewer.wait_for_function("() => !['empty', 'loading'].includes(document.querySelector('#passn-detail')"
                             ".dataset.state)")
    assert "HumanEval/" in viewer.inner_text("#passn-detail")
    screenshot(viewer, "passn-share")
    assert viewer.get_attribute("#passn-progress", "data-run") == ""  # a snapshot names no run ids
    # The owner's sample API answers only the owner: even knowing the run's id, the stranger gets nothing.
    run = page.get_attribute("#passn-progress", "data-run")
    query = "?problem=HumanEval/2&greedy=1&index=0"
    assert page.request.get(f"{server.url}/api/runs/{run}/sample{query}").status == 200
    assert viewer.request.get(f"{server.url}/api/runs/{run}/sample{query}").status == 404
    src = viewer.get_attribute("#passn-grid", "data-src")  # the newest run: /s/<token>/runs/<position>/sample
    with urllib.request.urlopen(f"{server.url}{src}{query}", timeout=10) as r:
        assert json.loads(r.read())["status"] in ("pass", "fail", "error", "timeout", "memory")
