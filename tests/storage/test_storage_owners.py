"""Deny by default: every Store method that reaches a session, a run or a link takes an owner, and None, a
malformed id or another owner gets nothing and changes nothing (the same answer as an unknown id). The
methods are found by introspection, so a new one is covered (or fails here) without editing this file."""
import inspect

import pytest

from laneplay.storage import OPERATOR, LimitReached, NotFound, Store, ValidationError, limits

from storage_testutil import gen, row_counts

OWNER, OTHER = "o" * 40, "p" * 40
# Parameters that name something of an owner's; a method taking one must take `owner` too.
REACHES = {"session_id", "comparison_id", "token"}
OWNERLESS = {"get_shared", "revoke_share"}  # by the token alone (a share page) / by the link's own secret


def owned(store):
    sid = store.create_session(title="mine", code="secret code", owner=OWNER)
    store.add_generations(sid, [gen()], owner=OWNER)
    cid = store.create_comparison(problem_set="user", problem_ids=["user/0"], n=1, temperature=0.5,
                                  session_id=sid, owner=OWNER)
    store.add_sample_results(cid, [{"problem_id": "user/0", "sample_index": 0, "status": "pass"}], owner=OWNER)
    token, _ = store.share_session(sid, owner=OWNER)
    return sid, cid, token, store.list_shares(sid, owner=OWNER)[0]["link"]


def public_methods():
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(Store, inspect.isfunction)
            if not name.startswith("_")}


def test_every_method_that_reaches_an_owners_rows_requires_an_owner():
    reaching = {name for name, sig in public_methods().items() if REACHES & set(sig.parameters)} - OWNERLESS
    assert {"get_session", "update_session", "delete_session", "add_generations", "share_session", "list_shares",
            "revoke_link", "get_comparison", "add_sample_results", "set_passk", "set_run_status"} <= reaching
    for name in sorted(reaching | {"create_session", "list_sessions", "list_comparisons", "fork_shared"}):
        param = public_methods()[name].parameters.get("owner")
        assert param is not None, f"Store.{name} reaches an owner's rows without taking an owner"
        if name not in ("owns", "owns_comparison"):
            assert param.default is inspect.Parameter.empty and param.kind == param.KEYWORD_ONLY, name


@pytest.mark.parametrize("stranger", [None, OTHER, "short", "x" * 500, 42, ""])
def test_no_owner_is_never_any_owner(store, stranger):
    sid, cid, token, link = owned(store)
    before = row_counts(store)
    assert store.get_session(sid, owner=stranger) is None
    assert store.get_comparison(cid, owner=stranger) is None
    assert store.list_sessions(owner=stranger) == [] and store.list_comparisons(owner=stranger) == []
    assert store.list_shares(sid, owner=stranger) == []
    assert not store.owns(sid, stranger) and not store.owns_comparison(cid, stranger)
    assert store.delete_session(sid, owner=stranger) is False
    assert store.revoke_link(sid, link, owner=stranger) is False
    writes = [lambda: store.update_session(sid, title="taken", owner=stranger),
              lambda: store.add_generations(sid, [gen(1)], owner=stranger),
              lambda: store.share_session(sid, owner=stranger),
              lambda: store.set_generation_test(sid, 1, 0, "fail", owner=stranger),
              lambda: store.add_sample_results(cid, [{"problem_id": "user/0", "sample_index": 0, "status": "fail",
                                                      "greedy": True}], owner=stranger),
              lambda: store.set_run_status(cid, "cancelled", owner=stranger),
              lambda: store.set_passk(cid, {1: 1.0}, owner=stranger),
              lambda: store.update_run_settings(cid, {"top_p": 0.5}, owner=stranger),
              lambda: store.set_problem_timing(cid, "user/0", {"greedy_ms": 1.0}, owner=stranger),
              lambda: store.create_comparison(problem_set="user", problem_ids=["user/0"], n=1, temperature=0.5,
                                              session_id=sid, owner=stranger)]
    for write in writes:
        with pytest.raises(NotFound):  # the same answer as an id that does not exist
            write()
    assert row_counts(store) == before
    s = store.get_session(sid, owner=OWNER)
    assert s["title"] == "mine" and len(s["generations"]) == 1
    assert store.get_shared(token)["code"] == "secret code"  # the one owner-less read: by the link's token


def test_nothing_is_made_without_an_owner(store):
    with pytest.raises(ValidationError, match="owner"):
        store.create_session(title="nobody's", owner=None)
    sid, _, token, _ = owned(store)
    with pytest.raises(ValidationError, match="owner"):
        store.fork_shared(token, owner=None)
    with pytest.raises(ValidationError, match="OPERATOR"):  # a standalone run is `laneplay eval`'s
        store.create_comparison(problem_set="x", problem_ids=["a"], n=1, temperature=0.5, owner=OWNER)
    assert [s["id"] for s in store.list_sessions(owner=OPERATOR)] == [sid]


def test_the_operator_reaches_every_row_and_its_own_are_nobodys(store):
    sid, cid, _, _ = owned(store)
    mine = store.create_session(title="operator's", owner=OPERATOR)
    assert store.get_session(sid, owner=OPERATOR)["title"] == "mine"
    assert store.get_comparison(cid, owner=OPERATOR)["n"] == 1
    assert store.get_session(mine, owner=OWNER) is None and store.list_sessions(owner=OWNER)[0]["id"] == sid


def test_an_owner_holds_at_most_its_share_of_sessions(store, monkeypatch):
    monkeypatch.setattr(limits, "MAX_SESSIONS_PER_OWNER", 3)
    for i in range(3):
        store.create_session(title=f"s{i}", owner=OWNER)
    with pytest.raises(LimitReached, match="delete some"):
        store.create_session(title="one more", owner=OWNER)
    token, _ = store.share_session(store.create_session(title="theirs", owner=OTHER), owner=OTHER)
    with pytest.raises(LimitReached):
        store.fork_shared(token, owner=OWNER)
    assert len(store.list_sessions(owner=OWNER)) == 3
    store.delete_session(store.list_sessions(owner=OWNER)[0]["id"], owner=OWNER)
    assert store.fork_shared(token, owner=OWNER)
