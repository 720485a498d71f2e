"""The DTP tab in a real browser against a real `laneplay serve --world-size 2` (its own server: the session's
runs at world size 1): A/B streams delayed then wait-now into two meters, then draws both ranks' timelines
for both modes and the table, beside the performance model's prediction."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from laneplay.processes import free_port

from .conftest import VIEWPORT, Recorder, Server, screenshot

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dtp_server(tmp_path_factory):
    """`laneplay serve` with 2 DTP ranks on CPU around a tiny random Laneformer shaped like the released one
    (8 lanes, 15 layers, delay 2, early blocking layers), with a byte-level tokenizer; own data dir and port."""
    from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint

    raw = tiny_laneformer_config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=15,
                                 num_attention_heads=16, num_key_value_heads=8, num_lanes=8, broadcast_delay=2,
                                 use_early_comm=True, sliding_window=64, sliding_window_n_layers=10,
                                 max_position_embeddings=1024)
    model = write_checkpoint(tmp_path_factory.mktemp("models") / "laneformer-tiny-random", raw,
                             random_laneformer_tensors(raw, seed=0))
    data = tmp_path_factory.mktemp("dtp-app-data")
    port, log = free_port(), data / "serve.log"
    env = dict(os.environ, LANEPLAY_DATA_DIR=str(data), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    env.pop("LANEPLAY_DATABASE_URL", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "laneplay", "serve", "--port", str(port), "--no-compile",
                                 "--world-size", "2", "--model", str(model)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        srv.wait_ready(300)  # the page answers first; the test opens it once the engine is ready
        yield srv
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the engine (and its ranks) die with the app
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def meter(page, elem_id: str) -> dict:
    return page.eval_on_selector(f"#{elem_id}", "m => ({state: m.dataset.state, tokens: Number(m.dataset.tokens), "
                                                "tps: m.dataset.tps, ms: m.dataset.msPerToken})")


def test_ab_streams_both_modes_then_shows_every_ranks_timeline_and_the_table(browser, dtp_server):
    ctx = browser.new_context(viewport={**VIEWPORT, "height": 1020})
    rec = Recorder()
    rec.attach(ctx)
    try:
        page = ctx.new_page()
        page.goto(dtp_server.url + "/")
        page.wait_for_selector("#meter")
        assert dtp_server.status()["world_size"] == 2
        t0 = time.monotonic()
        page.get_by_role("tab", name="DTP").click()
        page.wait_for_selector("#dtp-status[data-state='ready']", timeout=20_000)
        page.wait_for_selector("#dtp-prediction[data-available='1']", timeout=20_000)
        pred = page.eval_on_selector("#dtp-prediction", "p => ({...p.dataset, text: p.innerText})")
        assert float(pred["tpsDtp"]) > 0 and float(pred["tpsTp"]) > 0 and "8×H200" in pred["text"]
        assert pred["for"] in ("engine", "laneformer-2b") and "tokens/s with DTP" in pred["text"]
        assert page.input_value("#dtp-max-tokens input") == "64"

        page.click("#dtp-ab")
        page.wait_for_function("() => ['running', 'done'].includes(document.querySelector('#dtp-meter-delayed')"
                               ".dataset.state)", timeout=60_000)
        page.wait_for_function("() => document.querySelector('#dtp-meter-delayed').dataset.state === 'done' && "
                               "document.querySelector('#dtp-meter-wait').dataset.state === 'done'", timeout=60_000)
        for elem_id in ("dtp-meter-delayed", "dtp-meter-wait"):
            m = meter(page, elem_id)
            assert m["tokens"] > 0 and float(m["tps"]) > 0 and float(m["ms"]) > 0, m
        assert page.inner_text("#dtp-error") == ""

        page.wait_for_selector("#dtp-timeline g.lp-dtp-row", timeout=10_000)
        rows = page.eval_on_selector_all("#dtp-timeline g.lp-dtp-row",
                                         "rs => rs.map(r => [r.dataset.mode, Number(r.dataset.rank), "
                                         "Number(r.dataset.steps)])")
        assert sorted((m, r) for m, r, _ in rows) == [("delayed", 0), ("delayed", 1), ("wait_now", 0), ("wait_now", 1)]
        assert all(steps == 63 for _, _, steps in rows)  # 64 tokens: the first comes from the prefill
        kinds = set(page.eval_on_selector_all("#dtp-timeline rect[data-kind]", "rs => rs.map(r => r.dataset.kind)"))
        assert {"compute", "blocking", "exposed"} <= kinds
        tip = page.eval_on_selector("#dtp-timeline g.lp-dtp-step title", "t => t.textContent")
        assert "ms" in tip and "rank 0" in tip

        table = page.eval_on_selector("#dtp-table", "t => ({...t.dataset, modes: [...t.querySelectorAll("
                                                    "'tr[data-mode]')].map(r => r.dataset.mode)})")
        assert table["modes"] == ["delayed", "wait_now"] and table["worldSize"] == "2"
        assert float(table["msDelayed"]) > 0 and float(table["msWait"]) > 0 and table["hiddenShare"] != ""
        assert page.locator("#dtp-table td[data-rank='1'][data-kind='exposed']").count() == 2
        assert page.is_enabled("#dtp-ab")
        print(f"A/B in {time.monotonic() - t0:.1f} s: delayed {table['msDelayed']} ms/token, wait-now "
              f"{table['msWait']} ms/token, hidden share {table['hiddenShare']}")
        page.locator("#tab-dtp").scroll_into_view_if_needed()
        screenshot(page, "dtp-view")
    finally:
        ctx.close()
    rec.check()
