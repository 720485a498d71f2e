"""Share-link secrets and snapshots.

A link is /s/<token>: SHARE_TOKEN_BYTES random bytes from `secrets`, URL-safe base64. Whoever shared it
also gets an owner secret (needed to revoke). The database keeps only SHA-256 digests of both, so a
copy of the database does not hand out working links, and the token lookup is by digest (an index
search on a hash leaks nothing useful about the token's characters). The owner secret is checked
with `hmac.compare_digest`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

from laneplay.storage import limits
from laneplay.storage.models import iso, utcnow
from laneplay.storage.validate import ValidationError

SNAPSHOT_VERSION = 2  # 2: a generation's mode, instruction and code (where not its session's)
_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_NO_OWNER = "0" * 64  # compared against when the token is unknown: same work, never equal to a digest


def new_token() -> str:
    return secrets.token_urlsafe(limits.SHARE_TOKEN_BYTES)


def new_owner_secret() -> str:
    return secrets.token_urlsafe(limits.OWNER_SECRET_BYTES)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def is_token(value: object) -> bool:
    """Could `value` be a token we issued? Anything else is "not found" without touching the database."""
    return isinstance(value, str) and 16 <= len(value) <= limits.MAX_TOKEN_CHARS and set(value) <= _URLSAFE


def owner_matches(owner_secret: object, owner_hash: str | None) -> bool:
    given = digest(owner_secret) if is_token(owner_secret) else digest("")
    same = hmac.compare_digest(given, owner_hash or _NO_OWNER)
    return same and owner_hash is not None


ASKED = ("mode", "instruction", "code")  # what a generation was asked, as its session keeps it


def snapshot(session: dict[str, Any]) -> str:
    """The immutable copy behind a link: the session as `Store.get_session` returns it, minus every
    id (a session id is its owner's key to edit it; comparison ids would open get_comparison)."""
    snap = {k: x for k, x in session.items() if k != "id"}
    # an output asked what the session now shows keeps no copy of it (the page shows the session's)
    now = {k: session.get(k) for k in ASKED}
    snap["generations"] = [{k: x for k, x in g.items() if k not in ASKED or (x is not None and x != now[k])}
                           for g in session.get("generations") or []]
    snap["comparisons"] = [{k: x for k, x in c.items() if k not in ("id", "session_id")}
                           for c in session["comparisons"]]
    snap = {"snapshot_version": SNAPSHOT_VERSION, "shared_at": iso(utcnow()), **snap}
    text = json.dumps(snap, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    size = len(text.encode())
    if size > limits.MAX_SNAPSHOT_BYTES:
        raise ValidationError(f"snapshot: {size} bytes exceeds the limit of {limits.MAX_SNAPSHOT_BYTES} "
                              f"(MAX_SNAPSHOT_BYTES)")
    return text
