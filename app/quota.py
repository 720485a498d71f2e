"""What one browser (owner) and one client address may do: every number in one place (the README lists
them), token buckets for rates and counters for things that run.

An owner is a signed cookie (`app.owners`), cheap to get by loading the page again, so each owner limit
has an address limit beside it: made-up owners from one address share that address's allowance. The
address is the TCP peer (behind a reverse proxy, run uvicorn with its proxy-headers options so the peer
is the client).
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

from laneplay.storage import limits as storage_limits

# Generate in the Playground, Side by side and the DTP A/B: a burst, then a steady rate.
GENERATE_BURST_PER_OWNER = 20
GENERATE_PER_MINUTE_PER_OWNER = 30
GENERATE_BURST_PER_ADDRESS = 60
GENERATE_PER_MINUTE_PER_ADDRESS = 240
# "Run tests" in Side by side (generated code in the sandbox): a cookie, one at a time per owner.
SANDBOX_AT_ONCE_PER_OWNER = 1
SANDBOX_AT_ONCE_PER_ADDRESS = 2
SANDBOX_BURST_PER_OWNER = 10
SANDBOX_PER_MINUTE_PER_OWNER = 30
# pass@N runs (jobs on the server): one active per owner; of the server's active slots, an address gets
# at most a quarter, so made-up owners from one address cannot fill them.
PASSN_ACTIVE_PER_OWNER = 1
PASSN_ACTIVE = 8  # queued or running, server-wide
PASSN_RUNNING = 2  # generating at once, server-wide (the rest wait as queued)
PASSN_ACTIVE_PER_ADDRESS = max(1, PASSN_ACTIVE // 4)
# Forks of share links (each makes a session) per address.
FORK_BURST_PER_ADDRESS = 10
FORK_PER_MINUTE_PER_ADDRESS = 20
# New Gradio pages (a page load, or a script's new page id): each holds about 1 MB of the server's memory
# until it is forgotten (`app.pages`), so an address opens them at a bounded rate.
PAGES_BURST_PER_ADDRESS = 100
PAGES_PER_MINUTE_PER_ADDRESS = 60
# Sessions one owner keeps (History); past it, a new session is refused until some are deleted.
SESSIONS_PER_OWNER = storage_limits.MAX_SESSIONS_PER_OWNER

KEYS_TRACKED = 50_000  # buckets kept in memory at most (full, idle ones go first)


class Limited(Exception):
    """A request over one of the limits above; the message says which, and when to try again."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = max(1.0, float(retry_after_s))


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class Rate:
    """Token buckets by key: `burst` at once, refilled at `per_minute`."""

    def __init__(self, burst: int, per_minute: float, what: str):
        self.burst, self.per_s, self.what = float(burst), per_minute / 60.0, what
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, key: str, now: float | None = None, take: bool = True) -> float:
        """0 if a token is free for `key` now (and takes it, unless `take` is False), else the seconds until
        one is."""
        now = time.monotonic() if now is None else now
        with self._lock:
            b = self._buckets.pop(key, None) or _Bucket(self.burst, now)
            b.tokens = min(self.burst, b.tokens + (now - b.stamp) * self.per_s)
            b.stamp = now
            self._buckets[key] = b  # most recently used last
            if len(self._buckets) > KEYS_TRACKED:
                self._buckets.popitem(last=False)
            if b.tokens >= 1.0:
                b.tokens -= 1.0 if take else 0.0
                return 0.0
            return (1.0 - b.tokens) / self.per_s

    def refund(self, key: str) -> None:
        with self._lock:
            b = self._buckets.get(key)
            if b is not None:
                b.tokens = min(self.burst, b.tokens + 1.0)


class Running:
    """How many things each key has going at once."""

    def __init__(self):
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getitem__(self, key: str) -> int:
        return self._count.get(key, 0)

    def add(self, key: str, delta: int) -> None:
        with self._lock:
            n = self._count.get(key, 0) + delta
            if n > 0:
                self._count[key] = n
            else:
                self._count.pop(key, None)


def _minutes(per_minute: float) -> str:
    return f"{per_minute:g} a minute"


class Quota:
    """The app's limits, per owner and per client address."""

    def __init__(self):
        self.gen_owner = Rate(GENERATE_BURST_PER_OWNER, GENERATE_PER_MINUTE_PER_OWNER, "generations")
        self.gen_address = Rate(GENERATE_BURST_PER_ADDRESS, GENERATE_PER_MINUTE_PER_ADDRESS, "generations")
        self.sandbox_owner = Rate(SANDBOX_BURST_PER_OWNER, SANDBOX_PER_MINUTE_PER_OWNER, "test runs")
        self.forks = Rate(FORK_BURST_PER_ADDRESS, FORK_PER_MINUTE_PER_ADDRESS, "forks")
        self.pages = Rate(PAGES_BURST_PER_ADDRESS, PAGES_PER_MINUTE_PER_ADDRESS, "pages")
        self.sandbox_running = Running()

    @staticmethod
    def _refuse(what: str, wait_s: float, rule: str) -> Limited:
        wait = max(1, math.ceil(wait_s))
        return Limited(f"Too many {what}: the limit is {rule}. Try again in {wait} s.", wait)

    def generation(self, owner: str, address: str, take: bool = True) -> None:
        """Takes one Generate for `owner` from `address` (only looks, unless `take`), or raises Limited."""
        wait = self.gen_owner.wait_s(owner, take=take)
        if wait:
            raise self._refuse("generations from this browser", wait,
                               f"{GENERATE_BURST_PER_OWNER} at once, then {_minutes(GENERATE_PER_MINUTE_PER_OWNER)}")
        wait = self.gen_address.wait_s("a:" + address, take=take)
        if wait:
            if take:
                self.gen_owner.refund(owner)
            raise self._refuse("generations from this address", wait,
                               f"{GENERATE_BURST_PER_ADDRESS} at once, then "
                               f"{_minutes(GENERATE_PER_MINUTE_PER_ADDRESS)}")

    def new_page(self, address: str) -> None:
        wait = self.pages.wait_s(address)
        if wait:
            raise self._refuse("new pages from this address", wait,
                               f"{PAGES_BURST_PER_ADDRESS} at once, then {_minutes(PAGES_PER_MINUTE_PER_ADDRESS)}")

    def fork(self, address: str) -> None:
        wait = self.forks.wait_s(address)
        if wait:
            raise self._refuse("forks from this address", wait,
                               f"{FORK_BURST_PER_ADDRESS} at once, then {_minutes(FORK_PER_MINUTE_PER_ADDRESS)}")

    @contextmanager
    def sandbox_run(self, owner: str, address: str):
        """One "Run tests" for `owner` from `address` while the block runs, or Limited."""
        if self.sandbox_running["o:" + owner] >= SANDBOX_AT_ONCE_PER_OWNER:
            raise Limited("One test run at a time per browser: wait for the running one to finish.", 2)
        if self.sandbox_running["a:" + address] >= SANDBOX_AT_ONCE_PER_ADDRESS:
            raise Limited(f"At most {SANDBOX_AT_ONCE_PER_ADDRESS} test runs at a time from one address: wait for "
                          "one to finish.", 2)
        wait = self.sandbox_owner.wait_s(owner)
        if wait:
            raise self._refuse("test runs from this browser", wait,
                               f"{SANDBOX_BURST_PER_OWNER} at once, then {_minutes(SANDBOX_PER_MINUTE_PER_OWNER)}")
        keys = ("o:" + owner, "a:" + address)
        for k in keys:
            self.sandbox_running.add(k, 1)
        try:
            yield
        finally:
            for k in keys:
                self.sandbox_running.add(k, -1)


def address_of(request) -> str:
    """The client address of a request (Starlette's or Gradio's)."""
    client = getattr(request, "client", None) if request is not None else None
    host = getattr(client, "host", None)
    return str(host) if host else "unknown"
