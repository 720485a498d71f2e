"""Laneplay storage: sessions, generations, pass@N results and share links (SQLAlchemy 2, SQLite by
default, any SQLAlchemy URL works). Independent of the engine; `app` and `evals` use it.

    from laneplay.storage import Store, ValidationError, NotFound, OPERATOR
    db = Store(url=None)          # url, else $LANEPLAY_DATABASE_URL, else $LANEPLAY_DATA_DIR/laneplay.db
                                  # (default ./data); migrates to the newest schema on open

    # Deny by default: every call that reaches a session, run or link takes `owner=` (keyword, required):
    # a browser's owner id (>= 22 chars; only its SHA-256 is stored) or OPERATOR (the operator's own tools:
    # every row). None, a malformed id or another owner reads as if the row did not exist (None, [],
    # False) and writes raise NotFound.
    sid = db.create_session(*, owner, title="", model="", device="", world_size=1, columns=1,
                            code="", instruction="", params=None, mode=None) -> str   # LimitReached past
                                                 # MAX_SESSIONS_PER_OWNER
    db.get_session(sid, *, owner) -> dict | None  # with "generations" and "comparisons" (full)
    db.owns(sid, owner) -> bool
    db.update_session(sid, *, owner, **fields)   # any of title, model, device, world_size, columns,
                                                 # code, instruction, params, mode ("chat" | "complete")
    db.list_sessions(limit=50, *, owner) -> list[dict]  # summaries (+ best_tokens_per_second,
                                                 # generations, share_links), newest first
    db.delete_session(sid, *, owner) -> bool     # cascades, share links included
    db.add_generations(sid, records, *, owner) -> int  # one batch of <= 16 samples; its batch number.
        # record: mapping or object with sample_index, text, [seed, temperature, finish_reason] and the
        # engine's metrics fields prompt_tokens, completion_tokens, ttft_ms, decode_tokens_per_second,
        # ms_per_token, device, world_size (flat, or nested under "metrics")
    cid = db.create_comparison(*, owner, problem_set, problem_ids, n, temperature, greedy=True,
                               session_id=None, model="", tests=None) -> str   # no session: OPERATOR only
    db.add_sample_results(cid, results, *, owner) -> int  # problem_id, sample_index, status, [greedy,
                                                 # error, runtime_s, completion_tokens, generation_ms]
    db.set_passk(cid, {k: value}, *, owner, greedy_pass1=None, greedy_seconds=None, sampled_seconds=None)
    db.get_comparison(cid, *, owner) -> dict | None  # with "results" and "passk" [{"k", "value"}]
    db.list_comparisons(limit=50, *, owner) -> list[dict]
    token, owner_secret = db.share_session(sid, *, owner)  # freezes the session now
    db.get_shared(token) -> dict | None          # the snapshot (the one owner-less read); None if unknown
                                                 # or revoked (same answer)
    db.revoke_share(token, owner_secret) -> bool
    db.fork_shared(token, *, owner) -> str | None  # a new session of owner's with a copy of the snapshot
    db.list_shares(sid, *, owner) -> list[dict]  # [{"link", "created_at"}] of the session's live links
    db.revoke_link(sid, link, *, owner) -> bool  # revoke by that key
    db.close()

    storage.upgrade(url=None, revision="head") -> str   # also `laneplay db upgrade [--url URL]`
    storage.current(url=None) -> str | None             # also `laneplay db current`
    storage.downgrade(url, revision) -> str | None
    storage.limits                                      # every size/range limit, one module

Session and comparison ids are 128-bit random strings: they are their owner's keys (keep them out of
share URLs; snapshots carry no ids). Every write is one transaction; bad input raises ValidationError
(a ValueError naming the field and the limit, see storage.limits) and writes nothing; a write naming
an unknown session or comparison raises NotFound (a LookupError). Reads of unknown ids return None.
"""
from __future__ import annotations

import importlib

# Exports are resolved on first use: `laneplay --help` imports storage.cli and must stay fast.
_EXPORTS = {
    "Store": "laneplay.storage.store",
    "ValidationError": "laneplay.storage.validate",
    "NotFound": "laneplay.storage.validate",
    "LimitReached": "laneplay.storage.validate",
    "OPERATOR": "laneplay.storage.store",
    "upgrade": "laneplay.storage.db",
    "downgrade": "laneplay.storage.db",
    "current": "laneplay.storage.db",
    "head": "laneplay.storage.db",
    "database_url": "laneplay.storage.db",
    "make_engine": "laneplay.storage.db",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
