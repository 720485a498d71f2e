"""Fuzzing the Store API's inputs: whatever a caller passes (types, sizes, encodings), the answer is a
result or ValidationError / NotFound; never another exception, and a rejected write changes nothing."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laneplay.storage import OPERATOR, NotFound, Store, ValidationError

from .storage_testutil import gen, row_counts

# Text of every kind: lone surrogates, NULs, astral characters, long strings.
texts = st.one_of(
    st.text(alphabet=st.characters(codec=None, categories=None), max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.just("\ud800"), st.just("a\x00b"), st.just("x" * 70_000),
)
numbers = st.one_of(
    st.integers(), st.integers(min_value=10**300, max_value=10**400), st.just(-(10**400)),
    st.floats(allow_nan=True, allow_infinity=True), st.just(2**63), st.just(-1), st.booleans(),
)
leaves = st.one_of(st.none(), texts, numbers, st.binary(max_size=8))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.one_of(texts, st.integers()), inner,
                                                                      max_size=4)), max_leaves=8)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
OK = (ValidationError, NotFound)


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    s = Store(f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}")
    sid = s.create_session(title="base", owner=OPERATOR)
    cid = s.create_comparison(session_id=sid, problem_set="humaneval", problem_ids=["HumanEval/0"], n=2,
                              temperature=0.8, model="m", owner=OPERATOR)
    yield s, sid, cid
    s.close()


def _unchanged(store, before):
    assert row_counts(store) == before


@FUZZ
@given(field=st.sampled_from(["title", "model", "device", "world_size", "columns", "code", "instruction",
                              "params"]), value=values)
def test_create_and_update_session(fuzz_store, field, value):
    store, sid, _ = fuzz_store
    before = row_counts(store)
    try:
        new = store.create_session(**{field: value}, owner=OPERATOR)
    except OK:
        _unchanged(store, before)
    else:
        assert store.delete_session(new, owner=OPERATOR)
    try:
        store.update_session(sid, **{field: value}, owner=OPERATOR)
    except OK:
        pass


@FUZZ
@given(key=st.sampled_from(["text", "finish_reason", "prompt_tokens", "completion_tokens", "ttft_ms",
                            "decode_tokens_per_second", "ms_per_token", "device", "world_size", "seed",
                            "sample_index"]), value=values, records=st.one_of(values, st.just(None)))
def test_add_generations(fuzz_store, key, value, records):
    store, sid, _ = fuzz_store
    before = row_counts(store)
    rec = gen()
    rec[key] = value
    for batch in ([rec], records):
        try:
            store.add_generations(sid, batch, owner=OPERATOR)
        except OK:
            _unchanged(store, before)
        before = row_counts(store)


@FUZZ
@given(field=st.sampled_from(["problem_set", "problem_ids", "n", "temperature", "greedy", "model", "tests"]),
       value=values)
def test_create_comparison(fuzz_store, field, value):
    store, sid, _ = fuzz_store
    kw = dict(problem_set="humaneval", problem_ids=["HumanEval/0"], n=2, temperature=0.8, model="m")
    kw[field] = value
    before = row_counts(store)
    try:
        store.create_comparison(session_id=sid, **kw, owner=OPERATOR)
    except OK:
        _unchanged(store, before)


@FUZZ
@given(key=st.sampled_from(["problem_id", "greedy", "sample_index", "status", "error", "runtime_s",
                            "completion_tokens", "generation_ms"]), value=values,
       passk=values, greedy_pass1=values)
def test_sample_results_and_passk(fuzz_store, key, value, passk, greedy_pass1):
    store, _, cid = fuzz_store
    rec = dict(problem_id="HumanEval/0", greedy=False, sample_index=0, status="pass")
    rec[key] = value
    before = row_counts(store)
    try:
        store.add_sample_results(cid, [rec], owner=OPERATOR)
    except OK:
        _unchanged(store, before)
    for values_, g1 in ((passk, None), ({1: 0.5}, greedy_pass1)):
        try:
            store.set_passk(cid, values_, greedy_pass1=g1, owner=OPERATOR)
        except OK:
            pass


@FUZZ
@given(token=values, secret=values, session_id=values)
def test_ids_tokens_and_secrets(fuzz_store, token, secret, session_id):
    store, _, _ = fuzz_store
    before = row_counts(store)
    assert store.get_shared(token) is None
    assert store.fork_shared(token, owner=OPERATOR) is None
    assert store.revoke_share(token, secret) is False
    for call in (store.get_session, store.get_comparison):
        assert call(session_id, owner=OPERATOR) is None
    for call in (lambda: store.add_generations(session_id, [gen()], owner=OPERATOR),
                 lambda: store.share_session(session_id, owner=OPERATOR),
                 lambda: store.update_session(session_id, title="t", owner=OPERATOR)):
        with pytest.raises(OK):
            call()
    assert store.delete_session(session_id, owner=OPERATOR) is False
    _unchanged(store, before)


def test_the_probe_cases_are_validation_errors(fuzz_store):
    store, sid, cid = fuzz_store
    for bad in ("\ud800", "ok\udfff", "\ud83d"):
        with pytest.raises(ValidationError, match="surrogate"):
            store.create_session(title=bad, owner=OPERATOR)
        with pytest.raises(ValidationError, match="surrogate"):
            store.add_generations(sid, [gen(text=bad)], owner=OPERATOR)
    huge = 10**400
    with pytest.raises(ValidationError, match="ttft_ms"):
        store.add_generations(sid, [gen(ttft_ms=huge)], owner=OPERATOR)
    with pytest.raises(ValidationError, match="temperature"):
        store.create_comparison(problem_set="x", problem_ids=["a"], n=1, temperature=huge, owner=OPERATOR)
    with pytest.raises(ValidationError):
        store.set_passk(cid, {1: huge}, owner=OPERATOR)
    with pytest.raises(ValidationError):
        store.create_session(params={"temperature": -huge, "seed": huge}, owner=OPERATOR)
    assert math.isfinite(1.0)  # astral text is fine
    assert store.get_session(store.create_session(title="emoji 🚀 ok", owner=OPERATOR), owner=OPERATOR)["title"] == "emoji 🚀 ok"
