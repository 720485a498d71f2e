"""pass@N runs as jobs: status changes, per-problem timing, checked code, interruption, owners, forks;
side-by-side columns with their own settings and test outcomes."""
import pytest

from laneplay.storage import OPERATOR, NotFound, ValidationError

OWNER, OTHER = "o" * 30, "p" * 30


def _run(store, owner=OWNER, **kw):
    sid = store.create_session(title="t", owner=owner)
    cid = store.create_comparison(problem_set="humaneval", problem_ids=["HumanEval/0", "HumanEval/1"], n=2,
                                  temperature=0.8, session_id=sid, settings={"top_p": 0.95, "max_tokens": 64},
                                  owner=owner, **kw)
    return sid, cid


def test_a_run_moves_from_running_to_done_and_keeps_its_settings_timing_and_code(store):
    sid, cid = _run(store)
    assert store.get_comparison(cid, owner=OPERATOR)["status"] == "running"
    store.add_sample_results(cid, [{"problem_id": "HumanEval/0", "sample_index": 0, "status": "fail",
                                    "error": "AssertionError", "code": "def f():\n    return 1\n"}], owner=OPERATOR)
    store.set_problem_timing(cid, "HumanEval/0", {"greedy_ms": 120.0, "batch_ms": 300.5, "batch_tokens": 40}, owner=OPERATOR)
    store.set_passk(cid, {1: 0.0, 2: 0.5}, greedy_pass1=0.0, owner=OPERATOR)
    c = store.get_comparison(cid, owner=OPERATOR)
    assert c["status"] == "done" and c["finished_at"] is not None
    assert c["settings"] == {"top_p": 0.95, "max_tokens": 64}
    assert c["timing"]["HumanEval/0"]["batch_ms"] == 300.5
    assert c["results"][0]["code"].startswith("def f()")
    with pytest.raises(ValidationError):
        store.set_problem_timing(cid, "HumanEval/9", {"greedy_ms": 1.0}, owner=OPERATOR)
    with pytest.raises(ValidationError):
        store.set_problem_timing(cid, "HumanEval/0", {"wall": 1.0}, owner=OPERATOR)
    with pytest.raises(ValidationError):
        store.create_comparison(problem_set="x", problem_ids=["a"], n=1, temperature=0.5, settings={"bogus": 1}, owner=OPERATOR)


def test_an_ended_run_stays_ended_and_unfinished_runs_become_interrupted(store):
    _, cid = _run(store)
    store.set_run_status(cid, "cancelled", owner=OPERATOR)
    store.set_run_status(cid, "running", owner=OPERATOR)  # a late update from the cancelled job
    assert store.get_comparison(cid, owner=OPERATOR)["status"] == "cancelled"
    _, running = _run(store)
    _, queued = _run(store, status="queued")
    store.add_sample_results(running, [{"problem_id": "HumanEval/0", "sample_index": 1, "status": "pass"}], owner=OPERATOR)
    assert store.interrupt_unfinished() == 2
    assert store.get_comparison(running, owner=OPERATOR)["status"] == "interrupted"
    assert store.get_comparison(queued, owner=OPERATOR)["status"] == "interrupted"
    assert len(store.get_comparison(running, owner=OPERATOR)["results"]) == 1  # what finished is kept
    with pytest.raises(ValidationError):
        store.set_run_status(cid, "paused", owner=OPERATOR)
    with pytest.raises(NotFound):
        store.set_run_status("x" * 22, "done", owner=OPERATOR)


def test_runs_are_listed_per_owner_with_their_progress(store):
    _, mine = _run(store)
    _, theirs = _run(store, owner=OTHER)
    store.add_sample_results(mine, [{"problem_id": "HumanEval/0", "sample_index": 0, "status": "pass"}], owner=OPERATOR)
    listed = store.list_comparisons(owner=OWNER)
    assert [c["id"] for c in listed] == [mine]
    assert listed[0]["results_stored"] == 1 and listed[0]["problems"] == 2
    assert store.owns_comparison(mine, OWNER) and not store.owns_comparison(theirs, OWNER)
    assert {c["id"] for c in store.list_comparisons(owner=OPERATOR)} >= {mine, theirs}


def test_columns_keep_their_settings_and_test_outcome_through_share_and_fork(store):
    sid = store.create_session(title="sbs", owner=OWNER, columns=3)
    rows = [{"sample_index": i, "text": f"col {i}", "seed": i, "temperature": t, "top_p": p, "top_k": k,
             "kind": "side-by-side", "speculative": spec, "prompt_tokens": 5, "completion_tokens": 3}
            for i, (t, p, k, spec) in enumerate([(0.0, 1.0, 0, True), (0.2, 0.9, 40, False), (0.8, 0.95, 0, None)])]
    batch = store.add_generations(sid, rows, owner=OPERATOR)
    store.set_generation_test(sid, batch, 1, "fail", "AssertionError: x", owner=OPERATOR)
    _, cid = _run(store)
    with pytest.raises(NotFound):
        store.set_generation_test(sid, batch, 7, "pass", owner=OPERATOR)
    with pytest.raises(ValidationError):
        store.add_generations(sid, [{**rows[0], "kind": "sideways"}], owner=OPERATOR)
    with pytest.raises(ValidationError, match="speculative"):
        store.add_generations(sid, [{**rows[0], "speculative": "auto"}], owner=OPERATOR)
    running = store.create_comparison(problem_set="humaneval", problem_ids=["HumanEval/0"], n=1,
                                      temperature=0.5, session_id=sid, owner=OPERATOR)
    token, _ = store.share_session(sid, owner=OPERATOR)
    forked = store.get_session(store.fork_shared(token, owner=OTHER), owner=OTHER)
    gens = forked["generations"]
    assert [g["top_k"] for g in gens] == [0, 40, 0] and gens[1]["test_status"] == "fail"
    assert all(g["kind"] == "side-by-side" for g in gens)
    assert [g["speculative"] for g in gens] == [True, False, None]  # None: nothing was asked (older runs)
    assert [c["status"] for c in forked["comparisons"]] == ["interrupted"]  # a copy is never a live job
    assert store.get_comparison(running, owner=OPERATOR)["status"] == "running" and cid


def test_run_settings_merge_and_are_checked(store):
    sid = store.create_session(title="t", owner="o" * 32)
    cid = store.create_comparison(problem_set="user", problem_ids=["user/0"], n=2, temperature=0.8, session_id=sid,
                                  tests=["assert f(1) == 1"], settings={"prompt": "def f(x):\n", "entry_point": "f"}, owner=OPERATOR)
    store.update_run_settings(cid, {"step_ms": {"1": 10.5, "2": 12.0}}, owner=OPERATOR)
    got = store.get_comparison(cid, owner=OPERATOR)["settings"]
    assert got == {"prompt": "def f(x):\n", "entry_point": "f", "step_ms": {"1": 10.5, "2": 12.0}}
    for bad in ({"step_ms": {"17": 1.0}}, {"step_ms": {"1": -1.0}}, {"step_ms": [1]}, {"prompt": "x" * 70000},
                {"colour": "red"}):
        with pytest.raises(ValidationError):
            store.update_run_settings(cid, bad, owner=OPERATOR)
    assert store.get_comparison(cid, owner=OPERATOR)["settings"] == got
