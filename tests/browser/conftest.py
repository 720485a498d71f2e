"""Browser tests: Python Playwright driving Debian's chromium against a real `laneplay serve`.

The server (with its local engine, the embedded default model) and the browser start once per test run
(loading the model is most of a module's time on the 2-core machine); every test or module opens its own
browser contexts, so cookies, and so History, never leak from one to another. The browser tests run
after all the others (tests/conftest.py orders them last): Playwright's sync API keeps an event loop
running in the main thread while the browser is up, and other tests call asyncio.run() there. Every
request a page makes is recorded; anything not addressed to 127.0.0.1 is aborted and fails the test.

The flows also take the README's screenshots, but only when asked: `make screenshots` runs these tests
with LANEPLAY_SCREENSHOTS set to the folder to write them to (docs/screenshots); a plain test run writes
nothing into the repository.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from laneplay.processes import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
        "--disable-extensions", "--metrics-recording-only", "--mute-audio"]
VIEWPORT = {"width": 1280, "height": 900}


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/api/status", timeout=5) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.status()
                if st["state"] == "ready":
                    return st
            except OSError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.25)
        raise AssertionError(f"the engine was not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is required for the browser tests (the Makefile installs it with apt-get)")
    data = tmp_path_factory.mktemp("app-data")
    port = free_port()
    log = data / "serve.log"
    env = dict(os.environ, LANEPLAY_DATA_DIR=str(data), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    env.pop("LANEPLAY_DATABASE_URL", None)
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "laneplay", "serve", "--port", str(port), "--no-compile"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 60
    while True:  # the page must answer long before the engine is ready
        try:
            with urllib.request.urlopen(srv.url + "/", timeout=5) as r:
                assert r.status == 200
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    srv.page_answered_s = time.monotonic() - started
    yield srv
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@pytest.fixture(scope="session")
def browser():
    """One chromium for the run's browser tests, which come last (see the module's docstring)."""
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
    yield b
    b.close()
    pw.stop()


class Recorder:
    """Every request of a browser context: each host is recorded; a route aborts and lists any request
    that does not go to 127.0.0.1 (loopback requests are not intercepted, so streams flow untouched)."""

    def __init__(self):
        self.hosts: set[str] = set()
        self.outside: list[str] = []

    def attach(self, ctx) -> None:
        ctx.on("request", lambda req: self.hosts.add(urlsplit(req.url).hostname or req.url[:40]))
        ctx.route(lambda url: (urlsplit(url).hostname or "") != "127.0.0.1", self.block)

    def block(self, route):
        self.outside.append(route.request.url)
        return route.abort()

    def check(self) -> None:
        assert self.outside == [] and self.hosts <= {"127.0.0.1"}, (self.outside[:5], self.hosts)


@pytest.fixture
def new_context(browser):
    """new_context() -> (context, recorder); every context is checked for outside requests at the end."""
    made = []

    def make():
        ctx = browser.new_context(viewport=VIEWPORT)
        rec = Recorder()
        rec.attach(ctx)
        made.append((ctx, rec))
        return ctx, rec

    yield make
    for ctx, rec in made:
        ctx.close()
    for _, rec in made:
        rec.check()


def open_share(page, new_context, button: str = "#share"):
    """Press a share button on the owner's page and open the link it shows in a fresh context (no
    cookies): -> (the link, the viewer's page, already at the link with a 200)."""
    page.click(button)
    page.wait_for_selector("#share-link")
    link = page.get_attribute("#share-link", "href")
    vctx, _ = new_context()
    viewer = vctx.new_page()
    assert viewer.goto(link).status == 200
    return link, viewer


def fill_editor(page, selector: str, text: str, attempts: int = 3) -> None:
    """Type `text` into the code editor at `selector` (a gr.Code) in place of what it holds, and wait until
    its document is exactly that. Just after a page loads, the editor may not have its first value in
    place yet: a fill then can land beside that value instead of replacing it (the example code and the
    new code both in the editor), so a fill that did not take is done again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    content = page.locator(f"{selector} .cm-content")
    doc = "el => el.cmTile ? el.cmTile.view.state.doc.toString() : null"
    for _ in range(attempts):
        content.fill(text)
        try:
            page.wait_for_function(f"([sel, want]) => {{ const el = document.querySelector(sel + ' .cm-content');"
                                   f" return el && ({doc})(el) === want; }}", arg=[selector, text], timeout=3000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the editor {selector} holds {content.evaluate(doc)!r}, not {text!r}")


def screenshot(page, name: str) -> Path | None:
    """Saves the page as <name>.png in the folder LANEPLAY_SCREENSHOTS names (`make screenshots`); without
    it, nothing is written (None)."""
    folder = os.environ.get("LANEPLAY_SCREENSHOTS")
    if not folder:
        return None
    path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    return path
