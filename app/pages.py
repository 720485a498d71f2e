"""Gradio pages (a `session_hash` each): who may use one, and forgetting the ones nobody uses.

A page id belongs to the browser that first used it (`PageOwners`): a request naming another browser's
page is refused, so a copied page id reaches none of its events, states, stream or heartbeat.

Gradio keeps a copy of every component's configuration for each page id it has seen (about 1 MB with
this app's tabs) until 10,000 pages are held, and only frees it an hour after the page's heartbeat
closes. A script that calls the API with a new page id each time never opens a heartbeat, so each call
would keep its megabyte for good. `PageReaper` drops a page's state once nothing uses it: with no event
pending, after API_IDLE_S for a page that never opened a heartbeat (an API client), after CLOSED_KEEP_S
for a browser page whose heartbeat closed (a reload within that time finds its state), never while the
heartbeat is open.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import datetime
import hmac
import logging
import threading
from collections import OrderedDict

log = logging.getLogger("laneplay.app.pages")

API_IDLE_S = 60.0
CLOSED_KEEP_S = 15 * 60.0
REAP_EVERY_S = 10.0
OWNERS_KEPT = 200_000


class PageOwners:
    """Which owner each page id belongs to: the first one that used it."""

    def __init__(self, capacity: int = OWNERS_KEPT):
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, page: str, owner: str | None) -> tuple[bool, bool]:
        """(may `owner` use this page?, is it new?): a new page becomes `owner`'s."""
        who = owner or ""  # a cookieless page is anonymous: it holds nothing of anyone's
        with self._lock:
            held = self._owner.get(page)
            if held is None:
                self._owner[page] = who
                if len(self._owner) > self.capacity:
                    self._owner.popitem(last=False)
                return True, True
            self._owner.move_to_end(page)
            return hmac.compare_digest(held, who), False


def page_ids(path: str, query: dict, body: object) -> set[str]:
    """The page ids a Gradio request names: `session_hash` in its query or JSON body, or in the path of the
    per-page routes (heartbeat, media streams)."""
    found = set()
    if isinstance(query.get("session_hash"), str) and query["session_hash"]:
        found.add(query["session_hash"])
    if isinstance(body, dict) and isinstance(body.get("session_hash"), str) and body["session_hash"]:
        found.add(body["session_hash"])
    parts = path.split("/")
    for i, part in enumerate(parts[:-3]):  # /stream/<page>/<run>/<component>... (/stream/<event>: not a page)
        if part == "stream" and parts[i + 1]:
            found.add(parts[i + 1])
    beating = heartbeat_page(path)
    return found | {beating} if beating else found


def heartbeat_page(path: str) -> str | None:
    parts = path.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] == "heartbeat" and parts[-1] else None


def _trim_heap() -> None:
    """Hands freed heap pages back to the system (glibc), so the process's memory shrinks as pages go."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


class PageReaper:
    """Forgets the Gradio state of pages nobody uses (see the module's text)."""

    def __init__(self, blocks, api_idle_s: float = API_IDLE_S, closed_keep_s: float = CLOSED_KEEP_S):
        self.blocks = blocks
        self.api_idle_s, self.closed_keep_s = api_idle_s, closed_keep_s
        self.heartbeats: set[str] = set()  # pages that opened a heartbeat (browser pages)

    def reap(self, now: datetime.datetime | None = None) -> int:
        """Drops every idle page's state now; returns how many."""
        holder = getattr(self.blocks, "state_holder", None)
        queue = getattr(self.blocks, "_queue", None)
        if holder is None:
            return 0
        now = now or datetime.datetime.now()
        pending = getattr(queue, "pending_event_ids_session", {}) if queue is not None else {}
        dropped = []
        with holder.lock:
            for page, state in list(holder.session_data.items()):
                if pending.get(page):
                    continue
                last = holder.time_last_used.get(page)
                idle = (now - last).total_seconds() if last else float("inf")
                if page in self.heartbeats:
                    keep = float("inf") if not state.is_closed else self.closed_keep_s
                else:
                    keep = self.api_idle_s
                if idle > keep:
                    del holder.session_data[page]
                    holder.time_last_used.pop(page, None)
                    self.heartbeats.discard(page)
                    dropped.append(page)
        if dropped:
            try:
                from gradio import caching
                for page in dropped:
                    caching.clear_session_caches(page)
            except (ImportError, AttributeError):
                pass
            _trim_heap()
            log.info("forgot %d idle page(s)", len(dropped))
        return len(dropped)

    async def run(self, every_s: float = REAP_EVERY_S) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                self.reap()
            except Exception:  # noqa: BLE001 (a failed sweep is retried; the app goes on)
                log.warning("page sweep failed", exc_info=True)
