"""The Playground and History tabs and share links, in a real browser against a real `laneplay serve`."""
from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from laneplay.app.playground import editor_code

from .conftest import fill_editor, open_share, screenshot

pytestmark = pytest.mark.slow
INSTRUCTION = "Write a Python function add(a, b) that returns the sum of a and b."
LONG = "Write twenty different Python functions, each with a docstring and type hints."


def meter(page, elem="#meter") -> dict:
    return page.eval_on_selector(elem, "m => ({state: m.dataset.state, tokens: Number(m.dataset.tokens), "
                                       "tps: Number(m.dataset.tps || 0), ttft: Number(m.dataset.ttftMs || 0)})")


def wait_state(page, states, timeout=120.0, elem="#meter") -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = meter(page, elem)
        if m["state"] in states:
            return m
        time.sleep(0.05)
    raise AssertionError(f"{elem} never reached {states}; it is {meter(page, elem)}")


def output_text(page) -> str:
    return page.eval_on_selector("#output .cm-content", "el => el.cmTile ? el.cmTile.view.state.doc.toString() "
                                                          ": el.innerText")


def editor_text(page) -> str:
    return page.eval_on_selector("#code .cm-content", "el => el.cmTile.view.state.doc.toString()")


def open_playground(new_context, server):
    ctx, rec = new_context()
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    return ctx, rec, page


def set_field(page, elem_id: str, value: str) -> None:
    page.wait_for_selector(f"#{elem_id} input, #{elem_id} textarea")
    box = page.locator(f"#{elem_id} input").first if page.locator(f"#{elem_id} input").count() else \
        page.locator(f"#{elem_id} textarea").first
    box.fill(value)
    box.press("Tab")


def generate(page, instruction=INSTRUCTION, max_tokens=48, code="def add(a, b):\n"):
    fill_editor(page, "#code", code)
    page.locator("#instruction textarea").fill(instruction)
    set_field(page, "max-tokens", str(max_tokens))
    page.click("#generate")


def history_rows(page) -> list[str]:
    """Opens History (which reloads the list) and returns its rows' texts once the reload has landed."""
    before = page.get_attribute("#history-count", "data-seq") if page.locator("#history-count").count() else "0"
    page.get_by_role("tab", name="Playground").click()
    page.get_by_role("tab", name="History").click()
    page.wait_for_function(f"() => document.querySelector('#history-count') && "
                           f"document.querySelector('#history-count').dataset.seq !== '{before}'")
    count = int(page.get_attribute("#history-count", "data-count"))
    page.wait_for_function(f"() => document.querySelectorAll('#history [role=row]:not([aria-rowindex=\"1\"])')"
                           f".length >= {count}")
    rows = page.locator('#history [role=row]:not([aria-rowindex="1"])')  # body rows (1 is the header)
    return [t for t in rows.all_inner_texts() if t.strip()]


@pytest.fixture(scope="module")
def owner(browser, server):
    """One browser context that owns sessions across the tests of this module."""
    from .conftest import VIEWPORT, Recorder

    ctx = browser.new_context(viewport=VIEWPORT)
    rec = Recorder()
    rec.attach(ctx)
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    yield ctx, rec, page
    ctx.close()
    rec.check()


def test_the_page_answers_at_once_and_says_the_engine_is_loading(server, owner):
    _, _, page = owner
    # From the process start (imports included, without a bytecode cache on a busy 2-core machine).
    assert server.page_answered_s < 30, f"the page took {server.page_answered_s:.1f} s to answer"
    first = meter(page)["state"]
    assert first in ("loading", "idle")  # loading unless the engine was already up
    server.wait_ready()
    # the state line is refreshed every second by the server: it says ready within a few refreshes, and
    # the resting meter follows it
    page.wait_for_function("() => { const e = document.getElementById('engine-status');"
                           " return e !== null && e.getAttribute('data-state') === 'ready'; }", timeout=30_000)
    assert wait_state(page, ["idle"], timeout=30)["state"] == "idle"
    assert "ready" in page.inner_text("#engine-status")


def test_generate_streams_into_output_with_a_live_meter(server, owner):
    _, rec, page = owner
    generate(page)
    live = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = meter(page)
        if m["state"] == "running" and m["tps"] > 0 and output_text(page).strip():
            live = m
            screenshot(page, "playground-streaming")
            break
        assert m["state"] != "done", "the request ended before the meter showed a running rate"
        time.sleep(0.03)
    assert live is not None
    done = wait_state(page, ["done", "error"])
    assert done["state"] == "done", page.inner_text("#error")
    assert done["tokens"] >= live["tokens"] and done["tps"] > 0 and done["ttft"] > 0
    assert "def add" in output_text(page)
    screenshot(page, "playground-done")
    answer = output_text(page)
    page.click("#insert")  # the answer's code block, not its fence or prose, becomes the editor's code
    want = editor_code("chat", "def add(a, b):\n", INSTRUCTION, answer)
    assert "```" not in want and "def add" in want
    deadline = time.monotonic() + 10  # (the editor keeps no trailing newline)
    while editor_text(page) != want.rstrip("\n") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert editor_text(page) == want.rstrip("\n")
    assert rec.hosts == {"127.0.0.1"}, rec.hosts


def test_stop_ends_the_generation_and_frees_the_engine(server, owner):
    _, _, page = owner
    # a long run (thousands of tokens: tens of seconds even on a fast machine), so that a loaded machine
    # that delays the click still clicks while it runs
    generate(page, LONG, max_tokens=4000)
    deadline = time.monotonic() + 60
    while not (meter(page)["state"] == "running" and meter(page)["tokens"] >= 3):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    page.click("#stop")
    clicked = meter(page)
    stopped = wait_state(page, ["stopped", "done", "error"], timeout=10)
    assert stopped["state"] == "stopped" and 3 <= stopped["tokens"] < 4000, (clicked, stopped)  # its own state
    source = page.get_attribute("#meter", "data-source")
    assert source == "server" or "app-side timing" in page.inner_text("#meter"), source  # says whose timing
    screenshot(page, "playground-stopped")
    t0 = time.monotonic()
    deadline = t0 + 10
    while server.status().get("state") == "ready":  # the engine took the disconnect: nothing runs there
        with urllib.request.urlopen(server.status()["url"] + "/health", timeout=5) as r:
            import json
            if not json.loads(r.read())["busy"]:
                break
        assert time.monotonic() < deadline, "the engine kept generating after Stop"
        time.sleep(0.1)
    generate(page, INSTRUCTION, max_tokens=8)
    assert wait_state(page, ["done", "error"], timeout=60)["state"] == "done"


def test_a_400_character_line_wraps_in_the_output_with_its_indentation(server, owner):
    _, _, page = owner
    page.get_by_role("tab", name="Playground").click()
    line = "    x = [" + ", ".join(str(i) for i in range(120)) + "]"
    line = line[:400]
    assert len(line) == 400
    quiet_since, seen = time.monotonic(), output_text(page)
    while time.monotonic() - quiet_since < 1.0:  # the last run's updates have all landed: nothing rewrites it
        time.sleep(0.1)
        now = output_text(page)
        if now != seen:
            quiet_since, seen = time.monotonic(), now
    page.eval_on_selector("#output .cm-content", "(el, text) => { const v = el.cmTile.view; "
                          "v.dispatch({changes: {from: 0, to: v.state.doc.length, insert: text}}); }", line)
    assert output_text(page) == line
    sizes = page.eval_on_selector("#output .cm-scroller", "s => ({scroll: s.scrollWidth, client: s.clientWidth, "
                                  "height: s.querySelector('.cm-line').getBoundingClientRect().height, "
                                  "font: parseFloat(getComputedStyle(s.querySelector('.cm-line')).fontSize)})")
    assert sizes["scroll"] <= sizes["client"] + 1, sizes  # no horizontal scroll: the line wraps
    assert sizes["height"] > 3 * sizes["font"], sizes  # over several rows, all of it readable
    assert output_text(page) == line  # the indentation is kept


def test_bad_input_is_a_message_and_nothing_is_stored(server, owner):
    _, _, page = owner
    before = len(history_rows(page))
    page.get_by_role("tab", name="Playground").click()
    page.wait_for_selector("#generate", state="visible")
    set_field(page, "max-tokens", "0")
    page.click("#generate")
    page.wait_for_function("() => document.querySelector('#error').innerText.includes('Max tokens')")
    set_field(page, "max-tokens", "48")
    assert len(history_rows(page)) == before
    page.get_by_role("tab", name="Playground").click()


def test_share_fork_and_revoke(server, owner, new_context):
    octx, _, page = owner
    page.get_by_role("tab", name="Playground").click()
    page.click("#share")
    page.wait_for_selector("#share-link")
    link = page.get_attribute("#share-link", "href")
    assert "/s/" in link
    code = page.eval_on_selector("#code .cm-content", "el => el.cmTile ? el.cmTile.view.state.doc.toString() "
                                                       ": el.innerText")
    owner_rows = history_rows(page)

    vctx, _ = new_context()  # a stranger: no cookies
    viewer = vctx.new_page()
    resp = viewer.goto(link)
    assert resp.status == 200
    assert resp.headers["cache-control"] == "no-store" and resp.headers["referrer-policy"] == "no-referrer"
    assert viewer.inner_text("#code").strip() == code.strip()
    assert viewer.inner_text("#output").strip()
    assert viewer.locator("textarea, [contenteditable=true]").count() == 0  # read-only
    screenshot(viewer, "share-page")
    viewer.click("#fork")
    viewer.wait_for_url("**/?session=*")
    viewer.wait_for_selector("#meter")
    viewer.wait_for_function("() => document.querySelector('#meter').dataset.state === 'done'")
    # The fork is open, and its id has left the address bar (it would travel in screenshots and chats).
    viewer.wait_for_function("() => !window.location.search.includes('session=')")
    assert len(history_rows(viewer)) == 1  # the fork is in the viewer's History...
    assert len(history_rows(page)) == len(owner_rows)  # ...and not in the owner's

    page.locator('#history [role=row][aria-rowindex="2"] [role=gridcell]').first.click()
    # The selection has landed once the row's live links are listed (the link dropdown is set with them):
    # on a busy machine that can take longer than any fixed pause.
    page.wait_for_selector("#history-links li")
    page.click("#revoke")
    page.wait_for_function("() => document.querySelector('#history-notice').innerText.includes('Revoked')")
    screenshot(page, "history")
    gone = vctx.new_page()
    resp = gone.goto(link)
    assert resp.status == 404 and "This link does not exist or was revoked" in gone.inner_text("body")
    unknown = gone.goto(server.url + "/s/" + "A" * 43)
    assert unknown.status == 404 and "This link does not exist or was revoked" in gone.inner_text("body")


def test_a_shared_output_shows_the_request_it_answered(server, new_context):
    """Two runs of one session with different instructions: the share page shows the last one above all
    outputs, and the earlier output says what it was asked (folded under its heading)."""
    ctx, _, page = open_playground(new_context, server)
    first, second = "Write add(a, b) with type hints.", "Write add(a, b) with a docstring."
    generate(page, instruction=first, max_tokens=12)
    wait_state(page, ("done",))
    generate(page, instruction=second, max_tokens=12)
    page.wait_for_function("() => document.querySelector('#meter').dataset.state !== 'done'")
    wait_state(page, ("done",))
    _, viewer = open_share(page, new_context)
    assert viewer.inner_text("#instruction").strip() == second
    asked = viewer.locator("details.lp-asked")
    assert asked.count() == 1 and first not in viewer.inner_text("#instruction")
    asked.locator("summary").click()
    assert first in asked.inner_text() and "earlier request" in asked.inner_text()
    screenshot(viewer, "share-page-earlier-request")
    ctx.close()
    viewer.context.close()


def test_another_browser_never_sees_this_history(server, owner, new_context):
    ctx, _, page = open_playground(new_context, server)
    assert history_rows(page) == []


def test_a_killed_engine_is_an_error_then_restarted(server, owner):
    _, _, page = owner
    page.get_by_role("tab", name="Playground").click()
    st = server.wait_ready()
    os.kill(st["pid"], signal.SIGKILL)
    page.wait_for_function("() => document.querySelector('#error').innerText.trim().length > 0", timeout=30_000)
    assert "engine" in page.inner_text("#error").lower()
    server.wait_ready(timeout=240)
    generate(page, INSTRUCTION, max_tokens=8)
    # The meter still shows the last request's end (an earlier test's bad input): wait for this one first.
    wait_state(page, ["queued", "loading", "running", "done"], timeout=60)
    end = wait_state(page, ["done", "error"], timeout=120)["state"]
    assert end == "done", (page.inner_text("#error"), page.get_attribute("#meter", "data-state"), server.status())
    page.wait_for_function("() => document.querySelector('#error').innerText.trim() === ''", timeout=10_000)
    assert server.status()["restarts"] >= 1


def test_rename_and_delete_a_session_in_history(server, owner):
    _, _, page = owner
    before = history_rows(page)
    assert before, "the earlier tests left sessions in this browser's History"
    title = page.locator("#history-title textarea, #history-title input").first
    title.fill("")  # an earlier test selected a row: wait for this selection's title, not that one's
    first = before[0].split("\n")[0]
    page.locator('#history [role=row][aria-rowindex="2"] [role=gridcell]').first.click()
    page.wait_for_function("t => document.querySelector('#history-title textarea, #history-title input')"
                           ".value === t", arg=first)
    title.fill("Renamed in the browser test")
    title.press("Tab")
    time.sleep(0.3)
    page.click("#history-rename")
    page.wait_for_function("() => document.querySelector('#history-notice').innerText.includes('Renamed')")
    after = history_rows(page)
    assert len(after) == len(before) and sum("Renamed in the browser test" in r for r in after) == 1
    row = next(i for i, r in enumerate(after) if "Renamed in the browser test" in r)
    page.locator(f'#history [role=row][aria-rowindex="{row + 2}"] [role=gridcell]').first.click()
    page.wait_for_function("() => document.querySelector('#history-title textarea, #history-title input')"
                           ".value === 'Renamed in the browser test'")
    page.click("#history-delete")
    page.wait_for_function("() => document.querySelector('#history-notice').innerText.includes('Deleted')")
    gone = history_rows(page)
    assert len(gone) == len(before) - 1 and not any("Renamed in the browser test" in r for r in gone)


def checked_mode(page) -> str:
    return page.eval_on_selector("#mode", "m => { const i = m.querySelector('input:checked'); "
                                          "return i ? i.closest('label').innerText : ''; }")


def test_history_reopens_a_session_in_its_own_mode(server, owner):
    """A session made in Complete mode reopens in Complete mode (its title the code's first line), whatever
    mode the page was in."""
    _, _, page = owner
    page.get_by_role("tab", name="Playground").click()
    page.locator("#mode label", has_text="Complete").click()
    generate(page, "", max_tokens=8, code="def triple(x):\n")
    deadline = time.monotonic() + 90  # (the meter may still say the last run's "done": History says when)
    while not (rows := history_rows(page)) or not rows[0].startswith("def triple(x):"):  # newest first
        assert time.monotonic() < deadline, rows[:1]
        time.sleep(0.5)
    page.get_by_role("tab", name="Playground").click()
    page.locator("#mode label", has_text="Chat").click()
    assert "Chat" in checked_mode(page)
    assert history_rows(page)[0].startswith("def triple(x):")
    page.locator('#history [role=row][aria-rowindex="2"] [role=gridcell]').first.click()
    page.wait_for_function("() => document.querySelector('#history-title textarea, #history-title input')"
                           ".value.startsWith('def triple')")
    page.click("#history-open")
    page.wait_for_selector("#generate", state="visible")
    deadline = time.monotonic() + 10
    while "Complete" not in checked_mode(page) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Complete" in checked_mode(page)
    page.locator("#mode label", has_text="Chat").click()  # as the other tests expect it


def test_four_browsers_generate_together_and_each_meter_shows_its_wait(server, new_context):
    """Four people press Generate at once: the engine batches them (up to 16 rows a step), so all four
    meters run at the same time and all finish; each one's TTFT counts from its click (the wait for the
    engine included), with the engine's own TTFT and the wait beside it, and the meters say they shared
    the engine. (Four, not more: on the 2-core test machine each page costs a few seconds of CPU to load.)"""
    pages = [open_playground(new_context, server)[2] for _ in range(4)]
    server.wait_ready()
    for page in pages:
        wait_state(page, ["idle"], timeout=60)
        fill_editor(page, "#code", "def add(a, b):\n")
        page.locator("#instruction textarea").fill(LONG)  # a long task: the answers overlap
        set_field(page, "max-tokens", "64")
    for page in pages:
        page.click("#generate")
    together, shared, deadline = False, [False] * len(pages), time.monotonic() + 180
    while time.monotonic() < deadline:
        got = [p.eval_on_selector("#meter", "m => [m.dataset.state, m.dataset.sharing || '']") for p in pages]
        together |= all(st == "running" for st, _ in got)
        for i, (_, sharing) in enumerate(got):
            shared[i] |= sharing not in ("", "0")
        if all(st in ("done", "error") for st, _ in got):
            break
        time.sleep(0.02)
    assert together, [meter(p) for p in pages]
    finals = [p.eval_on_selector("#meter", "m => ({state: m.dataset.state, ttft: Number(m.dataset.ttftMs), "
                                           "engine: Number(m.dataset.engineTtftMs), "
                                           "queue: Number(m.dataset.queueMs), sharing: m.dataset.sharing})")
              for p in pages]
    assert all(f["state"] == "done" for f in finals), finals
    for f in finals:
        assert f["ttft"] >= f["engine"] + f["queue"] - 1, f  # the click's TTFT holds the wait and the engine's
    assert sum(shared) >= 3, shared  # they ran in the same steps, and the meters said so while they ran
    assert max(int(f["sharing"] or 0) for f in finals) >= 1, finals
    for p in pages:  # speculation ("auto", the default) beside others: the steps it held its drafts back, if any
        spec = p.eval_on_selector("#meter", "m => [m.dataset.acceptedPerStep, m.dataset.pausedSteps, "
                                            "m.dataset.draftingPaused, m.querySelector('.lp-tps').innerText]")
        assert spec[0] != "" and spec[1].isdigit() and spec[2] == "", spec  # the final counts; no pause at the end
        assert ("while sharing" in spec[3]) == (int(spec[1]) > 0), spec
    screenshot(pages[-1], "playground-shared")
