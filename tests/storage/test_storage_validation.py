"""Oversized or malformed input raises ValidationError naming the field (and the limit) and writes nothing."""
import math

import pytest

from laneplay.storage import OPERATOR, NotFound, Store, ValidationError, limits

from .storage_testutil import gen, make_comparison, row_counts


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One database for all rejected-input cases: each case checks that it wrote nothing."""
    s = Store(f"sqlite:///{tmp_path_factory.mktemp('validation') / 'laneplay.db'}")
    yield s
    s.close()


@pytest.fixture(scope="module")
def shared_ids(shared_store):
    return _populate(shared_store)


@pytest.fixture
def ids(store):
    return _populate(store)


def _populate(store):
    sid = store.create_session(title="target", owner=OPERATOR)
    store.add_generations(sid, [gen()], owner=OPERATOR)
    cid = make_comparison(store, sid, ["p0", "p1"], n=4, greedy=True)
    plain = make_comparison(store, None, ["p0"], n=2, greedy=False)
    return sid, cid, plain


big = lambda limit: "x" * (limit + 1)  # noqa: E731

# (call, expected words in the message: the field, and the limit's value and name where there is one)
CASES = {
    "title": (lambda s, i: s.create_session(title=big(limits.MAX_TITLE_CHARS), owner=OPERATOR),
              ["title", str(limits.MAX_TITLE_CHARS), "MAX_TITLE_CHARS"]),
    "code": (lambda s, i: s.create_session(code=big(limits.MAX_CODE_CHARS), owner=OPERATOR),
             ["code", str(limits.MAX_CODE_CHARS), "MAX_CODE_CHARS"]),
    "instruction": (lambda s, i: s.update_session(i[0], instruction=big(limits.MAX_INSTRUCTION_CHARS), owner=OPERATOR),
                    ["instruction", "MAX_INSTRUCTION_CHARS"]),
    "world_size": (lambda s, i: s.create_session(world_size=limits.MAX_WORLD_SIZE + 1, owner=OPERATOR),
                   ["world_size", "MAX_WORLD_SIZE"]),
    "columns": (lambda s, i: s.create_session(columns=limits.MAX_COLUMNS + 1, owner=OPERATOR), ["columns", "MAX_COLUMNS"]),
    "columns type": (lambda s, i: s.create_session(columns="2", owner=OPERATOR), ["columns", "integer"]),
    "bool is not int": (lambda s, i: s.create_session(world_size=True, owner=OPERATOR), ["world_size", "integer"]),
    "nul": (lambda s, i: s.create_session(code="a\x00b", owner=OPERATOR), ["code", "NUL"]),
    "params n": (lambda s, i: s.create_session(params={"n": 17}, owner=OPERATOR), ["params.n", "16", "MAX_SAMPLES"]),
    "params key": (lambda s, i: s.create_session(params={"temprature": 0.5}, owner=OPERATOR), ["params", "temprature"]),
    "params nan": (lambda s, i: s.create_session(params={"temperature": math.nan}, owner=OPERATOR), ["params.temperature"]),
    "params top_p": (lambda s, i: s.create_session(params={"top_p": 0.0}, owner=OPERATOR), ["params.top_p"]),
    "params stop": (lambda s, i: s.update_session(i[0], params={"stop": ["a"] * (limits.MAX_STOP_SEQUENCES + 1)}, owner=OPERATOR),
                    ["params.stop", "MAX_STOP_SEQUENCES"]),
    "params type": (lambda s, i: s.create_session(params=["n", 2], owner=OPERATOR), ["params", "mapping"]),
    "unknown field": (lambda s, i: s.update_session(i[0], colour="red", owner=OPERATOR), ["colour"]),
    "17 samples": (lambda s, i: s.add_generations(i[0], [gen(k % 16) for k in range(17)], owner=OPERATOR),
                   ["records", "16", "MAX_SAMPLES"]),
    "no samples": (lambda s, i: s.add_generations(i[0], [], owner=OPERATOR), ["records"]),
    "sample index": (lambda s, i: s.add_generations(i[0], [gen(16)], owner=OPERATOR), ["records[0].sample_index"]),
    "duplicate index": (lambda s, i: s.add_generations(i[0], [gen(0), gen(1), gen(0)], owner=OPERATOR), ["sample_index", "distinct"]),
    "output size": (lambda s, i: s.add_generations(i[0], [gen(0), gen(1, text=big(limits.MAX_OUTPUT_CHARS))], owner=OPERATOR),
                    ["records[1].text", "MAX_OUTPUT_CHARS"]),
    "missing text": (lambda s, i: s.add_generations(i[0], [{k: v for k, v in gen().items() if k != "text"}], owner=OPERATOR),
                     ["records[0].text"]),
    "negative tokens": (lambda s, i: s.add_generations(i[0], [gen(prompt_tokens=-1)], owner=OPERATOR), ["records[0].prompt_tokens"]),
    "inf metric": (lambda s, i: s.add_generations(i[0], [gen(ttft_ms=math.inf)], owner=OPERATOR), ["records[0].ttft_ms"]),
    "records type": (lambda s, i: s.add_generations(i[0], "text", owner=OPERATOR), ["records", "list"]),
    "record type": (lambda s, i: s.add_generations(i[0], [42], owner=OPERATOR), ["records[0]"]),
    "comparison n": (lambda s, i: make_comparison(s, i[0], n=limits.MAX_SAMPLES + 1), ["n", "MAX_SAMPLES"]),
    "nothing to run": (lambda s, i: s.create_comparison(problem_set="x", problem_ids=["a"], n=0, temperature=0.0,
                                                        greedy=False, owner=OPERATOR), ["n", "greedy"]),
    "problems": (lambda s, i: make_comparison(s, i[0], [f"p{k}" for k in range(limits.MAX_PROBLEMS + 1)]),
                 ["problem_ids", "MAX_PROBLEMS"]),
    "no problems": (lambda s, i: make_comparison(s, i[0], []), ["problem_ids"]),
    "duplicate problems": (lambda s, i: make_comparison(s, i[0], ["p0", "p0"]), ["problem_ids", "distinct"]),
    "problem id size": (lambda s, i: make_comparison(s, i[0], [big(limits.MAX_PROBLEM_ID_CHARS)]),
                        ["problem_ids[0]", "MAX_PROBLEM_ID_CHARS"]),
    "tests count": (lambda s, i: make_comparison(s, i[0], tests=["assert True"] * (limits.MAX_TESTS + 1)),
                    ["tests", "MAX_TESTS"]),
    "test size": (lambda s, i: make_comparison(s, i[0], tests=[big(limits.MAX_TEST_CHARS)]),
                  ["tests[0]", "MAX_TEST_CHARS"]),
    "temperature": (lambda s, i: s.create_comparison(problem_set="x", problem_ids=["a"], n=1, temperature=limits.MAX_TEMPERATURE + 0.5, owner=OPERATOR),
                    ["temperature", "MAX_TEMPERATURE"]),
    "status": (lambda s, i: s.add_sample_results(i[1], [dict(problem_id="p0", sample_index=0, status="passed")], owner=OPERATOR),
               ["results[0].status", "pass, fail, timeout, memory, error"]),
    "foreign problem": (lambda s, i: s.add_sample_results(i[1], [dict(problem_id="p7", sample_index=0, status="pass")], owner=OPERATOR),
                        ["results[0].problem_id"]),
    "index >= n": (lambda s, i: s.add_sample_results(i[1], [dict(problem_id="p0", sample_index=4, status="pass")], owner=OPERATOR),
                   ["results[0].sample_index", "0..3"]),
    "no greedy": (lambda s, i: s.add_sample_results(i[2], [dict(problem_id="p0", sample_index=0, greedy=True,
                                                                status="pass")], owner=OPERATOR), ["results[0].greedy"]),
    "half a batch": (lambda s, i: s.add_sample_results(i[1], [dict(problem_id="p0", sample_index=0, status="pass"),
                                                              dict(problem_id="p1", sample_index=0, status="??")], owner=OPERATOR),
                     ["results[1].status"]),
    "duplicate result": (lambda s, i: s.add_sample_results(i[1], [dict(problem_id="p0", sample_index=1,
                                                                        status="pass")] * 2, owner=OPERATOR),
                         ["results", "once"]),
    "k > n": (lambda s, i: s.set_passk(i[1], {1: 0.5, 5: 0.9}, owner=OPERATOR), ["passk", "1..4"]),
    "passk value": (lambda s, i: s.set_passk(i[1], {1: 1.5}, owner=OPERATOR), ["passk[1]"]),
    "greedy pass1 without greedy": (lambda s, i: s.set_passk(i[2], {1: 0.5}, greedy_pass1=0.5, owner=OPERATOR), ["greedy_pass1"]),
    "list limit": (lambda s, i: s.list_sessions(limit=limits.MAX_SESSIONS_LISTED + 1, owner=OPERATOR),
                   ["limit", "MAX_SESSIONS_LISTED"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rejected_and_nothing_written(shared_store, shared_ids, name):
    call, words, store, ids = *CASES[name], shared_store, shared_ids
    before, session = row_counts(store), store.get_session(ids[0], owner=OPERATOR)
    with pytest.raises(ValidationError) as err:
        call(store, ids)
    assert isinstance(err.value, ValueError)
    for w in words:
        assert w in str(err.value), f"{w!r} not in {str(err.value)!r}"
    assert row_counts(store) == before
    assert store.get_session(ids[0], owner=OPERATOR) == session  # not even updated_at moved


def test_unknown_ids_in_writes_raise_not_found(store, ids):
    before = row_counts(store)
    for call in (lambda: store.add_generations("A" * 22, [gen()], owner=OPERATOR),
                 lambda: store.update_session("nope", title="x", owner=OPERATOR),
                 lambda: make_comparison(store, "A" * 22),
                 lambda: store.add_sample_results("A" * 22, [], owner=OPERATOR),
                 lambda: store.set_passk("A" * 22, {1: 0.5}, owner=OPERATOR)):
        with pytest.raises(NotFound):
            call()
    assert row_counts(store) == before


def test_error_excerpts_are_cut_not_rejected(store, ids):
    tail = "\nAssertionError: expected 3"
    store.add_sample_results(ids[1], [dict(problem_id="p0", sample_index=0, status="fail", error="x" * 50_000 + tail)], owner=OPERATOR)
    error = store.get_comparison(ids[1], owner=OPERATOR)["results"][0]["error"]
    assert len(error) == limits.MAX_ERROR_CHARS and error.endswith(tail)


def test_per_session_caps(store, ids, monkeypatch):
    sid = ids[0]
    monkeypatch.setattr(limits, "MAX_GENERATIONS_PER_SESSION", 4)
    store.add_generations(sid, [gen(0), gen(1), gen(2)], owner=OPERATOR)  # 1 + 3 = 4
    before = row_counts(store)
    with pytest.raises(ValidationError, match="MAX_GENERATIONS_PER_SESSION"):
        store.add_generations(sid, [gen(0)], owner=OPERATOR)
    monkeypatch.setattr(limits, "MAX_COMPARISONS_PER_SESSION", 1)
    with pytest.raises(ValidationError, match="MAX_COMPARISONS_PER_SESSION"):
        make_comparison(store, sid)
    assert row_counts(store) == before
