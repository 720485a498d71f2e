"""The pass@N tab's pieces without a browser: input checks, the HTML built from a stored run (progress,
grid, table, chart, comparison; hostile text escaped), and the sample endpoints' ownership rules."""
import re

import pytest
from fastapi.testclient import TestClient

from laneplay.app.context import AppContext
from laneplay.app.jobs import RunInputError
from laneplay.app.owners import COOKIE, OwnerKeys
from laneplay.app.passn import chosen_problems, config_of, search_problems
from laneplay.app.passn_view import chart_svg, compare_html, grid_html, progress_html, table_html
from laneplay.app.supervisor import RemoteEngine
from laneplay.app.web import create_app
from laneplay.evals.passk import pass_at_k
from laneplay.storage import OPERATOR, Store

OWNER = "o" * 40
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'view.db'}")
    yield s
    s.close()


def stored_run(store, statuses=(("pass", "fail", "pass", "pass"), ("fail", "fail", "fail", "pass")), n=3,
               finish=True, owner=OWNER):
    """Two problems, greedy + n samples each; statuses[i] = (greedy, sample 0, ...)."""
    sid = store.create_session(title="t", owner=owner)
    ids = ["HumanEval/0", "HumanEval/1"]
    cid = store.create_comparison(problem_set="humaneval", problem_ids=ids, n=n, temperature=0.8, session_id=sid,
                                  settings={"step_ms": {"1": 10.0, "2": 12.0}}, owner=OPERATOR)
    for pid, sts in zip(ids, statuses):
        store.set_problem_timing(cid, pid, {"greedy_ms": 1000.0, "batch_ms": 1500.0, "batch_ttft_ms": 100.0,
                                            "batch_tokens": 51, "greedy_tokens": 40}, owner=OPERATOR)
        store.add_sample_results(cid, [{"problem_id": pid, "greedy": j == 0, "sample_index": max(j - 1, 0),
                                        "status": s, "error": None if s == "pass" else f"AssertionError {HOSTILE}",
                                        "code": f"def f():\n    return '{HOSTILE}'"} for j, s in enumerate(sts)], owner=OPERATOR)
    if finish:
        store.set_passk(cid, {1: 0.5}, greedy_pass1=0.5, owner=OPERATOR)
    return sid, cid


def test_inputs_are_checked_before_anything_runs():
    with pytest.raises(RunInputError, match="N must be one of"):
        config_of("3", 0.8, 0.95, 64, 0, "instruct")
    with pytest.raises(RunInputError, match="whole number"):
        config_of("2", 0.8, 0.95, 64.5, 0, "instruct")
    with pytest.raises(RunInputError, match="number"):
        config_of("2", "warm", 0.95, 64, 0, "instruct")
    with pytest.raises(RunInputError, match="temperature"):
        config_of("2", 0.0, 0.95, 64, 0, "instruct")
    assert config_of("16", 1.2, 1.0, 2048, None, "base").n == 16
    for spec in ("", "0-999", "HumanEval/9999", "zero", "0-" + "1" * 3000):
        with pytest.raises(RunInputError):
            chosen_problems("humaneval", spec, "", "")
    with pytest.raises(RunInputError, match="at most 40"):
        chosen_problems("humaneval", "0-41", "", "")
    problems, pset = chosen_problems("humaneval", "0-2, HumanEval/7", "", "")
    assert [p.task_id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/7"] and pset == "humaneval"
    for prompt, tests in (("def f(x):\n", ""), ("def f(x):\n", "f(1)"), ("def f(x):\n", "assert f(1) ==")):
        with pytest.raises(RunInputError, match="Your problem"):
            chosen_problems("own", "", prompt, tests)
    (own,), pset = chosen_problems("own", "", "def twice(x):\n", "assert twice(2) == 4")
    assert own.entry_point == "twice" and pset == "user"
    found = search_problems("palindrome")
    assert found and all("HumanEval/" in value for _, value in found)
    assert search_problems("") == [] and len(search_problems("def")) <= 25


def test_the_run_reads_the_same_live_reopened_or_shared(store):
    _, cid = stored_run(store)
    run = store.get_comparison(cid, owner=OPERATOR)
    prog = progress_html(run)
    assert re.search(r'data-state="done" data-done="2" data-total="2" data-checked="8" data-samples="8"', prog)
    grid = grid_html(run, "/api/runs/x/sample")
    cells = re.findall(r'data-status="(\w+)"', grid)
    assert cells == ["pass", "fail", "pass", "pass", "fail", "fail", "fail", "pass"]
    table = table_html(run)
    got = {int(k): float(v) for k, v in re.findall(r'data-k="(\d)" data-passk="([\d.]+)"', table)}
    expect = {k: (pass_at_k(3, 2, k) + pass_at_k(3, 1, k)) / 2 for k in (1, 2)}  # from the results, k <= N
    assert got == pytest.approx(expect, abs=1e-4)
    assert 'data-greedy-pass1="0.5000"' in table
    # k < N: the batch's TTFT + its 50 decode steps at the step time measured at batch k; vs the 1 s greedy call
    assert "0.60 s</td><td>×0.60" in table and "0.70 s</td><td>×0.70" in table
    chart = chart_svg([run])
    assert 'data-series="1"' in chart and chart.count("<circle") == 2 and "lp-greedy-line" in chart
    for html_text in (prog, grid, table, chart):
        assert HOSTILE not in html_text


def test_partial_and_unfinished_runs_show_what_finished(store):
    _, cid = stored_run(store, statuses=(("pass", "fail", "pass", "pass"), ("fail",)), finish=False)
    run = store.get_comparison(cid, owner=OPERATOR)
    assert re.search(r'data-state="running" data-done="1" data-total="2" data-checked="5"', progress_html(run))
    assert "over 1 of 2 problems so far" in table_html(run)
    assert grid_html(run, "").count('data-status="pending"') == 3
    store.set_run_status(cid, "interrupted", owner=OPERATOR)
    assert "the server stopped during the run" in progress_html(store.get_comparison(cid, owner=OPERATOR))


def test_a_comparison_puts_the_runs_in_one_table_and_chart(store):
    _, a = stored_run(store)
    _, b = stored_run(store, statuses=(("pass", "pass", "pass", "pass"), ("pass", "pass", "fail", "pass")))
    runs = [store.get_comparison(a, owner=OPERATOR), store.get_comparison(b, owner=OPERATOR)]
    table = compare_html(runs)
    assert 'data-runs="2"' in table and table.count("<tr data-k=") == 2 and "greedy pass@1" in table
    assert 'data-series="2"' in chart_svg(runs, "passn-compare-chart")


def test_a_sample_is_served_to_its_owner_and_through_a_share_link_only(store, tmp_path):
    sid, cid = stored_run(store)
    keys = OwnerKeys(tmp_path / "keys.json")
    app = create_app(AppContext(engine=RemoteEngine("http://127.0.0.1:9"), store=store, owners=keys))
    query = "?problem=HumanEval/0&greedy=0&index=1"
    with TestClient(app) as client:
        client.cookies.set(COOKIE, OWNER)  # the owner's id itself, unsigned: a made-up cookie
        assert client.get(f"/api/runs/{cid}/sample{query}").status_code == 404
        client.cookies.set(COOKIE, keys.issue(OWNER)[1])
        mine = client.get(f"/api/runs/{cid}/sample{query}")
        assert mine.status_code == 200 and mine.json()["status"] == "pass" and HOSTILE in mine.json()["code"]
        assert mine.headers["content-type"].startswith("application/json")  # data, never rendered as HTML
        assert client.get(f"/api/runs/{cid}/sample?problem=HumanEval/0&greedy=0&index=9").status_code == 404
        client.cookies.set(COOKIE, keys.issue("p" * 40)[1])
        assert client.get(f"/api/runs/{cid}/sample{query}").status_code == 404
        client.cookies.clear()
        assert client.get(f"/api/runs/{cid}/sample{query}").status_code == 404
        token, _ = store.share_session(sid, owner=OPERATOR)
        page = client.get(f"/s/{token}")
        assert page.status_code == 200 and 'id="passn-table"' in page.text and HOSTILE not in page.text
        assert cid not in page.text  # a snapshot names no run ids: its runs go by position
        assert client.get(f"/s/{token}/runs/0/sample{query}").json()["status"] == "pass"
        for bad in (f"/s/{'A' * 43}/runs/0/sample{query}", f"/s/{token}/runs/1/sample{query}",
                    f"/s/{token}/runs/-1/sample{query}", f"/s/{token}/runs/{cid}/sample{query}"):
            assert client.get(bad).status_code in (404, 422), bad


def test_the_app_marks_runs_of_a_stopped_server_interrupted_as_it_starts(store, tmp_path):
    _, cid = stored_run(store, statuses=(("pass", "fail"), ()), finish=False)
    assert store.get_comparison(cid, owner=OPERATOR)["status"] == "running"
    create_app(AppContext(engine=RemoteEngine("http://127.0.0.1:9"), store=store,
                          owners=OwnerKeys(tmp_path / "keys.json")))
    run = store.get_comparison(cid, owner=OPERATOR)
    assert run["status"] == "interrupted" and len(run["results"]) == 2  # what finished is kept
    assert "the server stopped during the run" in progress_html(run)
