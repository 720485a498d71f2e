"""Share links: unguessable tokens, immutable snapshots, revoke, fork, and nothing reachable by guessing."""
import base64
import json
import math
import sqlite3
from collections import Counter

import pytest
from sqlalchemy import text

from laneplay.storage import OPERATOR, share as share_mod
from laneplay.storage import ValidationError, limits

from .storage_testutil import gen, make_comparison

URLSAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@pytest.fixture
def shared(store):
    """A session with generations and a finished comparison, shared."""
    sid = store.create_session(title="shared", model="m", code="def f(): pass\n", instruction="write f",
                               params={"temperature": 0.2, "n": 2}, owner=OPERATOR)
    store.add_generations(sid, [gen(0), gen(1, text="other")], owner=OPERATOR)
    cid = make_comparison(store, sid, ["p0", "p1"], n=2)
    store.add_sample_results(cid, [dict(problem_id=p, sample_index=j, status="pass" if j else "fail")
                                   for p in ("p0", "p1") for j in range(2)]
                             + [dict(problem_id="p0", sample_index=0, greedy=True, status="pass")], owner=OPERATOR)
    store.set_passk(cid, {1: 0.5, 2: 1.0}, greedy_pass1=0.5, greedy_seconds=0.5, sampled_seconds=1.0, owner=OPERATOR)
    token, owner = store.share_session(sid, owner=OPERATOR)
    return sid, cid, token, owner


def test_tokens_are_unguessable(store):
    sid = store.create_session(owner=OPERATOR)
    pairs = [store.share_session(sid, owner=OPERATOR) for _ in range(limits.MAX_SHARES_PER_SESSION)]
    tokens = [t for t, _ in pairs]
    for token, owner in pairs:
        assert set(token) <= URLSAFE and set(owner) <= URLSAFE  # goes in a URL as is
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        assert len(raw) * 8 >= 128 and len(token) >= 22
        assert owner != token
    assert len(set(tokens)) == len(tokens) and not set(tokens) & {o for _, o in pairs}
    # Entropy over many tokens: ~6 bits per base64 character, so a token carries well over 128 bits.
    many = [share_mod.new_token() for _ in range(2000)]
    counts = Counter("".join(t[:-1] for t in many))  # the last character carries padding bits
    total = sum(counts.values())
    bits_per_char = -sum(c / total * math.log2(c / total) for c in counts.values())
    assert bits_per_char > 5.9 and bits_per_char * (len(many[0]) - 1) >= 128
    assert len(set(many)) == len(many)


def test_snapshot_is_immutable(store, shared):
    sid, cid, token, _ = shared
    before = store.get_shared(token)
    assert before["title"] == "shared" and len(before["generations"]) == 2
    assert before["comparisons"][0]["passk"] == [{"k": 1, "value": 0.5}, {"k": 2, "value": 1.0}]
    assert len(before["comparisons"][0]["results"]) == 5

    store.update_session(sid, title="edited", code="changed", params={}, owner=OPERATOR)
    store.add_generations(sid, [gen(0, text="later")], owner=OPERATOR)
    store.add_sample_results(cid, [dict(problem_id="p1", sample_index=0, greedy=True, status="fail")], owner=OPERATOR)
    store.set_passk(cid, {1: 0.0}, owner=OPERATOR)
    make_comparison(store, sid, ["p9"], n=1)
    assert store.get_shared(token) == before

    before["title"] = "mutated by a caller"  # each read is a fresh copy
    assert store.get_shared(token)["title"] == "shared"

    # And the database refuses to change a stored snapshot, whatever the code path.
    with store.engine.begin() as conn, pytest.raises(Exception, match="immutable"):
        conn.execute(text("UPDATE share_links SET snapshot = '{}'"))


def test_revoke(store, shared):
    _, _, token, owner = shared
    assert store.revoke_share(token, "x" * len(owner)) is False  # wrong secret: nothing happens
    assert store.revoke_share(token, token) is False
    assert store.revoke_share(token, None) is False
    assert store.get_shared(token) is not None
    assert store.revoke_share(token, owner) is True
    assert store.get_shared(token) is None
    assert store.fork_shared(token, owner=OPERATOR) is None
    assert store.revoke_share(token, owner) is False


def test_revoked_and_unknown_tokens_look_the_same(store, shared):
    _, _, token, owner = shared
    unknown = share_mod.new_token()
    store.revoke_share(token, owner)
    for t in (token, unknown):
        assert store.get_shared(t) is None
        assert store.fork_shared(t, owner=OPERATOR) is None
        assert store.revoke_share(t, owner) is False
    for junk in ("", "a", token[:-1], token + "A", "../../etc/passwd", "x" * 10_000, None, 12345, b"bytes"):
        assert store.get_shared(junk) is None
        assert store.revoke_share(junk, owner) is False


def test_owner_secret_compared_in_constant_time(store, shared, monkeypatch):
    _, _, token, owner = shared
    calls = []
    real = share_mod.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(share_mod.hmac, "compare_digest", spy)
    assert store.revoke_share(share_mod.new_token(), owner) is False  # unknown token: same work
    assert store.revoke_share(token, "wrong-secret-wrong-secret") is False
    assert store.revoke_share(token, owner) is True
    assert len(calls) == 3


def test_fork_copies_the_snapshot_into_a_new_session(store, shared):
    sid, _, token, _ = shared
    snap = store.get_shared(token)
    store.update_session(sid, title="edited after sharing", owner=OPERATOR)
    fork = store.fork_shared(token, owner=OPERATOR)
    assert fork not in (None, sid)
    got = store.get_session(fork, owner=OPERATOR)
    for k in ("title", "model", "device", "world_size", "columns", "code", "instruction", "params"):
        assert got[k] == snap[k]
    drop = lambda d, keys: {k: v for k, v in d.items() if k not in keys}  # noqa: E731
    # a snapshot keeps what a generation was asked only where it is not the session's: the fork has it all
    asked = {k: snap[k] for k in share_mod.ASKED}
    assert [drop(g, {"created_at"}) for g in got["generations"]] == \
        [drop({**asked, **g}, {"created_at"}) for g in snap["generations"]]
    volatile = {"id", "session_id", "created_at", "finished_at"}
    assert [drop(c, volatile) for c in got["comparisons"]] == [drop(c, volatile) for c in snap["comparisons"]]

    store.update_session(fork, title="my fork", owner=OPERATOR)  # the fork is editable and independent
    assert store.get_shared(token) == snap and store.get_session(sid, owner=OPERATOR)["title"] == "edited after sharing"
    assert store.get_session(fork, owner=OPERATOR)["comparisons"][0]["id"] != store.get_session(sid, owner=OPERATOR)["comparisons"][0]["id"]


def test_nothing_reachable_by_enumeration(store, shared, db_url):
    sid, cid, token, owner = shared
    other = store.create_session(title="someone else's", owner=OPERATOR)
    for i in (sid, cid, other):  # random 128-bit ids, not counters
        assert len(i) == 22 and set(i) <= URLSAFE
    assert len({sid, cid, other}) == 3
    for guess in (0, 1, 2, "0", "1", "2", "", None, sid[:-1], sid + "A", token[:22],
                  {"id": sid}, ["x"]):
        assert store.get_session(guess, owner=OPERATOR) is None
        assert store.get_comparison(guess, owner=OPERATOR) is None
        assert store.get_shared(guess) is None

    # The snapshot names no session or comparison: it cannot be used to reach the editable session.
    blob = json.dumps(store.get_shared(token))
    assert sid not in blob and cid not in blob and other not in blob and "someone else" not in blob
    assert "id" not in store.get_shared(token) and "session_id" not in store.get_shared(token)["comparisons"][0]

    # Only digests of the token and the owner secret are stored.
    store.close()
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    dump = "\n".join(con.iterdump())
    con.close()
    assert token not in dump and owner not in dump and share_mod.digest(token) in dump


def test_share_limits_and_unknown_session(store):
    sid = store.create_session(owner=OPERATOR)
    for _ in range(limits.MAX_SHARES_PER_SESSION):
        store.share_session(sid, owner=OPERATOR)
    with pytest.raises(ValidationError, match="MAX_SHARES_PER_SESSION"):
        store.share_session(sid, owner=OPERATOR)
    from laneplay.storage import NotFound
    with pytest.raises(NotFound):
        store.share_session("A" * 22, owner=OPERATOR)


def test_deleting_the_session_kills_its_links(store, shared):
    sid, _, token, _ = shared
    store.delete_session(sid, owner=OPERATOR)
    assert store.get_shared(token) is None


def test_a_sessions_snapshots_are_bounded_in_total(store, monkeypatch):
    # Big sessions shared again and again must not grow the database without bound.
    monkeypatch.setattr(limits, "MAX_SHARED_BYTES_PER_SESSION", 300_000)
    sid = store.create_session(code="x" * 60_000, owner=OPERATOR)
    for _ in range(4):
        store.share_session(sid, owner=OPERATOR)  # ~60 k characters each
    with pytest.raises(ValidationError, match="MAX_SHARED_BYTES_PER_SESSION"):
        store.share_session(sid, owner=OPERATOR)


def test_owners_see_only_their_sessions_and_forks_join_the_forkers_history(store):
    alice, bob = "a" * 43, "b" * 43
    mine = store.create_session(title="alice's", owner=alice)
    store.add_generations(mine, [gen(decode_tokens_per_second=123.0), gen(1, decode_tokens_per_second=150.0)], owner=OPERATOR)
    theirs = store.create_session(title="bob's", owner=bob)
    listed = store.list_sessions(owner=alice)
    assert [s["id"] for s in listed] == [mine]
    assert listed[0]["best_tokens_per_second"] == 150.0 and listed[0]["generations"] == 2
    assert store.get_session(theirs, owner=alice) is None and store.get_session(mine, owner=alice)["title"]
    assert store.owns(mine, alice) and not store.owns(mine, bob) and not store.owns(mine, "short")
    token, _ = store.share_session(mine, owner=OPERATOR)
    assert store.list_sessions(owner=alice)[0]["share_links"] == 1
    forked = store.fork_shared(token, owner=bob)
    assert sorted(s["id"] for s in store.list_sessions(owner=bob)) == sorted([theirs, forked])
    assert [s["id"] for s in store.list_sessions(owner=alice)] == [mine]
    (link,) = store.list_shares(mine, owner=OPERATOR)
    assert store.revoke_link(theirs, link["link"], owner=OPERATOR) is False  # another session's key does nothing
    assert store.revoke_link(mine, link["link"], owner=OPERATOR) is True and store.get_shared(token) is None
    assert store.list_shares(mine, owner=OPERATOR) == [] and store.revoke_link(mine, link["link"], owner=OPERATOR) is False
    with pytest.raises(ValidationError, match="owner"):
        store.create_session(owner="too-short")
