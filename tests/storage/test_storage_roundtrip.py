"""Every entity goes in and comes back out unchanged; pass@k stored equals pass@k recomputed."""
import dataclasses
import random
from datetime import datetime
from types import SimpleNamespace

import pytest
from sqlalchemy import text

from laneplay.evals.passk import pass_at_k  # what the caller (laneplay eval) computes and stores
from laneplay.storage import OPERATOR, NotFound, Store, ValidationError

from .storage_testutil import gen, make_comparison, passk_formula, row_counts


SESSION = dict(title="two-sum", model="kogai/laneformer-2b-it", device="cuda", world_size=8, columns=3,
               code="def two_sum(nums, target):\n    ...\n", instruction="Complete the function. ünïcödé ✓",
               params=dict(max_tokens=256, temperature=0.7, top_p=0.95, top_k=50, seed=7, stop=["\ndef "], n=3))


def test_session_round_trip(store):
    sid = store.create_session(**SESSION, owner=OPERATOR)
    got = store.get_session(sid, owner=OPERATOR)
    assert {k: got[k] for k in SESSION} == SESSION
    assert got["id"] == sid and got["generations"] == [] and got["comparisons"] == []
    created = datetime.fromisoformat(got["created_at"])
    assert created.utcoffset().total_seconds() == 0 and got["updated_at"] == got["created_at"]

    store.update_session(sid, title="renamed", code="x = 1\n", params={"temperature": 0.0}, owner=OPERATOR)
    got2 = store.get_session(sid, owner=OPERATOR)
    assert (got2["title"], got2["code"], got2["params"]) == ("renamed", "x = 1\n", {"temperature": 0.0})
    assert got2["instruction"] == SESSION["instruction"] and got2["created_at"] == got["created_at"]
    assert got2["updated_at"] > got["updated_at"]


def test_a_session_keeps_its_playground_mode(store):
    sid = store.create_session(code="def f():\n", mode="complete", owner=OPERATOR)
    assert store.get_session(sid, owner=OPERATOR)["mode"] == "complete"
    store.update_session(sid, mode="chat", owner=OPERATOR)
    assert store.get_session(sid, owner=OPERATOR)["mode"] == "chat"
    assert store.get_session(store.create_session(owner=OPERATOR), owner=OPERATOR)["mode"] is None  # not said
    with pytest.raises(ValidationError, match="mode"):
        store.update_session(sid, mode="poem", owner=OPERATOR)
    token, _ = store.share_session(sid, owner=OPERATOR)
    assert store.get_session(store.fork_shared(token, owner=OPERATOR), owner=OPERATOR)["mode"] == "chat"


def test_session_defaults_list_and_delete(store):
    a = store.create_session(owner=OPERATOR)
    assert store.get_session(a, owner=OPERATOR)["params"] == {} and store.get_session(a, owner=OPERATOR)["world_size"] == 1
    b = store.create_session(title="b", owner=OPERATOR)
    store.update_session(a, title="a, touched last", owner=OPERATOR)
    listed = store.list_sessions(limit=10, owner=OPERATOR)
    assert [s["id"] for s in listed] == [a, b]
    assert set(listed[0]) == {"id", "created_at", "updated_at", "title", "model", "device", "world_size",
                              "best_tokens_per_second", "generations", "share_links"}
    assert len(store.list_sessions(limit=1, owner=OPERATOR)) == 1

    store.add_generations(a, [gen()], owner=OPERATOR)
    make_comparison(store, a)
    store.share_session(a, owner=OPERATOR)
    assert store.delete_session(a, owner=OPERATOR) is True
    assert store.get_session(a, owner=OPERATOR) is None and store.delete_session(a, owner=OPERATOR) is False
    assert row_counts(store) == {"sessions": 1, "generations": 0, "comparisons": 0, "sample_results": 0,
                                 "passk": 0, "share_links": 0}
    with pytest.raises(NotFound):
        store.update_session(a, title="gone", owner=OPERATOR)


@dataclasses.dataclass
class Metrics:  # stands in for the engine's metrics record: attribute access, asdict() gives the names
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    decode_tokens_per_second: float
    ms_per_token: float
    device: str
    world_size: int
    prefill_ms: float = 3.0  # a field storage does not keep


def test_generations_round_trip(store):
    sid = store.create_session(owner=OPERATOR)
    first = [gen(k, text=f"sample {k}", seed=None if k == 2 else k, ttft_ms=None if k == 1 else 10.0 + k)
             for k in range(4)]
    assert store.add_generations(sid, first, owner=OPERATOR) == 1
    # The other accepted shapes: an event-like object with the metrics record nested, and a flat object.
    m = Metrics(100, 20, 33.5, 512.25, 1.953125, "cuda", 4)
    event_like = SimpleNamespace(sample_index=0, text="x", finish_reason="length", seed=None, temperature=None,
                                 metrics=m)
    flat = SimpleNamespace(sample_index=1, text="y", **{k: v for k, v in dataclasses.asdict(m).items()})
    assert store.add_generations(sid, [event_like, flat], owner=OPERATOR) == 2

    got = store.get_session(sid, owner=OPERATOR)["generations"]
    assert [(g["batch"], g["sample_index"]) for g in got] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    for stored, sent in zip(got[:4], first):
        assert {k: stored[k] for k in sent} == sent
    metrics = {k: v for k, v in dataclasses.asdict(m).items() if k != "prefill_ms"}
    assert {k: got[4][k] for k in metrics} == metrics and got[4]["finish_reason"] == "length"
    assert {k: got[5][k] for k in metrics} == metrics and got[5]["finish_reason"] is None
    assert "prefill_ms" not in got[4] and "id" not in got[4]


def test_comparison_round_trip_and_passk_matches_stored_samples(store):
    rng = random.Random(0)
    sid = store.create_session(owner=OPERATOR)
    problems, n = [f"HumanEval/{i}" for i in range(6)], 16
    cid = make_comparison(store, sid, problems, n=n, tests=None)
    statuses = ("pass", "fail", "timeout", "memory", "error")
    results = []
    for i, p in enumerate(problems):
        rate = i / (len(problems) - 1)  # from never to always passing
        for j in range(n):
            st = "pass" if rng.random() < rate else rng.choice(statuses[1:])
            results.append(dict(problem_id=p, sample_index=j, status=st, runtime_s=0.01 * j,
                                error=None if st == "pass" else f"AssertionError in {p}",
                                completion_tokens=30 + j, generation_ms=100.0 + j))
        results.append(dict(problem_id=p, sample_index=0, greedy=True, status="pass" if i % 2 else "fail"))
    assert store.add_sample_results(cid, results[:40], owner=OPERATOR) == 40  # two calls: results arrive as they finish
    assert store.add_sample_results(cid, iter(results[40:]), owner=OPERATOR) == len(results) - 40

    # The caller (evals) computes pass@k from its outcomes; storage keeps what it is given.
    passed = {p: sum(r["status"] == "pass" for r in results if r["problem_id"] == p and not r.get("greedy"))
              for p in problems}
    ks = (1, 2, 4, 8, 16)
    given = {k: sum(pass_at_k(n, c, k) for c in passed.values()) / len(problems) for k in ks}
    greedy = sum(i % 2 for i in range(len(problems))) / len(problems)
    store.set_passk(cid, given, greedy_pass1=greedy, greedy_seconds=1.5, sampled_seconds=12.25, owner=OPERATOR)

    c = store.get_comparison(cid, owner=OPERATOR)
    assert c == store.get_session(sid, owner=OPERATOR)["comparisons"][0]
    assert (c["id"], c["session_id"], c["problem_set"], c["problem_ids"], c["n"], c["temperature"], c["greedy"]) \
        == (cid, sid, "humaneval", problems, n, 0.8, True)
    assert (c["greedy_pass1"], c["greedy_seconds"], c["sampled_seconds"]) == (greedy, 1.5, 12.25)
    assert c["finished_at"] is not None and c["model"] == "smollm2-135m-instruct"
    assert len(c["results"]) == len(results)
    by_key = {(r["problem_id"], r["greedy"], r["sample_index"]): r for r in c["results"]}
    for r in results:
        stored = by_key[(r["problem_id"], r.get("greedy", False), r["sample_index"])]
        assert {k: stored[k] for k in r} == r

    # Recompute from what is stored (samples only, not the greedy baseline) with the formula itself.
    samples = [r for r in c["results"] if not r["greedy"]]
    for p in c["passk"]:
        counts = [sum(r["status"] == "pass" for r in samples if r["problem_id"] == q) for q in c["problem_ids"]]
        assert all(sum(r["problem_id"] == q for r in samples) == n for q in c["problem_ids"])
        recomputed = sum(passk_formula(n, cc, p["k"]) for cc in counts) / len(counts)
        assert p["value"] == pytest.approx(recomputed, abs=1e-12)
    assert [p["k"] for p in c["passk"]] == list(ks)
    greedy_stored = [r for r in c["results"] if r["greedy"]]
    assert c["greedy_pass1"] == sum(r["status"] == "pass" for r in greedy_stored) / len(problems)

    # set_passk replaces the earlier values.
    store.set_passk(cid, {1: 0.5}, owner=OPERATOR)
    assert store.get_comparison(cid, owner=OPERATOR)["passk"] == [{"k": 1, "value": 0.5}]


def test_standalone_comparison_and_listing(store):
    cid = make_comparison(store, None, ["p0"], n=1, greedy=False, tests=["assert f(1) == 2", "assert f(0) == 1"])
    store.add_sample_results(cid, [dict(problem_id="p0", sample_index=0, status="pass")], owner=OPERATOR)
    store.set_passk(cid, {1: 1.0}, owner=OPERATOR)
    c = store.get_comparison(cid, owner=OPERATOR)
    assert c["session_id"] is None and c["tests"] == ["assert f(1) == 2", "assert f(0) == 1"]
    assert c["greedy"] is False and c["greedy_pass1"] is None
    listed = store.list_comparisons(limit=5, owner=OPERATOR)
    assert [x["id"] for x in listed] == [cid] and "results" not in listed[0]
    assert listed[0]["passk"] == [{"k": 1, "value": 1.0}]


def test_default_location_and_env_url(tmp_path, monkeypatch):
    monkeypatch.delenv("LANEPLAY_DATABASE_URL", raising=False)
    monkeypatch.setenv("LANEPLAY_DATA_DIR", str(tmp_path / "data-dir"))
    with Store() as s:
        s.create_session(title="in the data dir", owner=OPERATOR)
    assert (tmp_path / "data-dir" / "laneplay.db").is_file()

    monkeypatch.setenv("LANEPLAY_DATABASE_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    with Store() as s:
        assert s.list_sessions(owner=OPERATOR) == []
    assert (tmp_path / "elsewhere.db").is_file()


def test_every_connection_gets_the_pragmas(store):
    conns = [store.engine.connect() for _ in range(3)]  # three distinct pooled connections
    try:
        for conn in conns:
            q = lambda p: conn.execute(text(f"PRAGMA {p}")).scalar_one()  # noqa: E731
            assert q("journal_mode") == "wal"
            assert q("foreign_keys") == 1
            assert q("busy_timeout") >= 5_000
            assert q("synchronous") == 2  # FULL
    finally:
        for conn in conns:
            conn.close()


def test_in_memory_database():
    with Store("sqlite://") as s:
        sid = s.create_session(title="memory", owner=OPERATOR)
        s.add_generations(sid, [gen()], owner=OPERATOR)
        assert s.get_session(sid, owner=OPERATOR)["generations"][0]["text"] == gen()["text"]
