"""Owner cookies: a browser is known by a random owner id that this server signed.

The cookie holds `<owner id>.<signature>`: 256 random bits and an HMAC-SHA256 of them (itsdangerous'
`Signer`) under a server secret. Only ids this server issued verify, so a made-up, copied-and-edited or
truncated cookie is no owner at all: the next page load replaces it with a new signed one, and until
then every owner-only action refuses it. The database stores only each owner id's SHA-256.

The secret lives in the data directory (`$LANEPLAY_DATA_DIR`, default ./data) as `owner-keys.json`
(mode 0600), created on first use. `laneplay secret rotate` adds a new key: the newest key signs, the
older ones (up to KEYS_KEPT in all) still verify, and a browser whose cookie was signed with an older
key gets it re-signed, same owner id, on its next page load, so nobody loses their History.
`laneplay secret rotate --drop-old` keeps only the new key: every cookie issued before stops being an
owner (use it when the secret may have leaked). A running server picks up a rotated file within a second.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from pathlib import Path

from itsdangerous import BadSignature, Signer

from laneplay.storage import limits
from laneplay.storage.db import data_dir

COOKIE = "laneplay_owner"
OWNER_BYTES = 32  # 256 random bits per owner id
KEY_BYTES = 32
KEY_FILE = "owner-keys.json"
KEYS_KEPT = 3  # the newest signs; older keys keep verifying until they fall off or are dropped
MAX_AGE_S = 90 * 24 * 3600  # renewed on every page load; an unused browser is forgotten after 90 days
SALT = "laneplay.owner-cookie"
RELOAD_EVERY_S = 1.0
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def is_owner_id(value: object) -> bool:
    return isinstance(value, str) and limits.MIN_OWNER_CHARS <= len(value) <= limits.MAX_OWNER_CHARS and \
        set(value) <= _ID_CHARS


class OwnerKeys:
    """The signing keys of owner cookies, kept in one file of the data directory."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else data_dir() / KEY_FILE
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp: tuple[int, int] | None = None
        self._newest: Signer | None = None
        self._all: Signer | None = None

    # -- the key file --------------------------------------------------------------------------

    def _read_keys(self) -> list[str]:
        with open(self.path, encoding="utf-8") as f:
            keys = json.load(f)["keys"]
        if not keys or not all(isinstance(k, str) and len(k) >= 32 for k in keys):
            raise ValueError(f"{self.path.name}: no usable keys")
        return keys

    def _write_keys(self, keys: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"keys": keys}, f)
            f.write("\n")
        os.replace(tmp, self.path)

    def _create_once(self) -> None:
        """The first key, written only if no file exists (two processes starting together agree on one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"keys": [secrets.token_hex(KEY_BYTES)]}, f)
            f.write("\n")

    def _signers(self) -> tuple[Signer, Signer]:
        with self._lock:
            now = time.monotonic()
            if self._newest is None or now - self._checked >= RELOAD_EVERY_S:
                self._checked = now
                if not self.path.exists():
                    self._create_once()
                st = self.path.stat()
                stamp = (st.st_mtime_ns, st.st_ino)
                if stamp != self._stamp or self._newest is None:
                    keys = self._read_keys()
                    self._newest = Signer(keys[-1], salt=SALT, digest_method=hashlib.sha256)
                    self._all = Signer(keys, salt=SALT, digest_method=hashlib.sha256)
                    self._stamp = stamp
            return self._newest, self._all

    def rotate(self, drop_old: bool = False) -> int:
        """A new signing key; the older ones keep verifying (KEYS_KEPT in all) unless `drop_old`.
        Returns how many keys verify now."""
        with self._lock:
            if not self.path.exists():
                self._create_once()
            keys = [] if drop_old else self._read_keys()
            keys = (keys + [secrets.token_hex(KEY_BYTES)])[-KEYS_KEPT:]
            self._write_keys(keys)
            self._newest = None
        return len(keys)

    def count(self) -> int:
        self._signers()
        return len(self._read_keys())

    # -- cookies -------------------------------------------------------------------------------

    def issue(self, owner: str | None = None) -> tuple[str, str]:
        """(owner id, cookie value): a new random owner id, or `owner` re-signed with the newest key."""
        owner = owner if owner is not None else secrets.token_urlsafe(OWNER_BYTES)
        return owner, self._signers()[0].sign(owner).decode()

    def read(self, value: object) -> tuple[str | None, bool]:
        """(owner id or None, signed with the newest key?) of a cookie value. None for anything this server
        did not sign: missing, made up, edited, truncated, signed with a dropped key."""
        if not isinstance(value, str) or not 24 <= len(value) <= 256 or not value.isascii():
            return None, False
        newest, every = self._signers()
        for signer, current in ((newest, True), (every, False)):
            try:
                owner = signer.unsign(value).decode()
            except (BadSignature, UnicodeDecodeError):
                continue
            return (owner, current) if is_owner_id(owner) else (None, False)
        return None, False

    def owner_of(self, request) -> str | None:
        """The owner id of a request (Starlette's or Gradio's) from its signed cookie; None if it has none."""
        cookies = getattr(request, "cookies", None) if request is not None else None
        value = cookies.get(COOKIE) if hasattr(cookies, "get") else None
        return self.read(value)[0]

