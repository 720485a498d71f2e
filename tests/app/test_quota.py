"""The app's limits on their own: token buckets (burst, refill, per key), Generate per owner and per
address, one sandbox run at a time per owner, and the page sweep that forgets idle Gradio pages."""
import datetime
from types import SimpleNamespace

import pytest

from laneplay.app import quota
from laneplay.app.pages import PageOwners, PageReaper, heartbeat_page, page_ids
from laneplay.app.quota import Limited, Quota, Rate


def test_a_bucket_gives_its_burst_then_refills_at_its_rate():
    r = Rate(3, 60, "things")  # 3 at once, then one a second
    assert [r.wait_s("k", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert r.wait_s("k", now=0.0) == pytest.approx(1.0)
    assert r.wait_s("other", now=0.0) == 0.0  # keys do not share
    assert r.wait_s("k", now=0.5) == pytest.approx(0.5)
    assert r.wait_s("k", now=1.0) == 0.0 and r.wait_s("k", now=1.0) > 0
    assert r.wait_s("k", now=100.0, take=False) == 0.0 and r.wait_s("k", now=100.0, take=False) == 0.0  # looks


def test_generations_are_limited_per_owner_and_per_address():
    q = Quota()
    for _ in range(quota.GENERATE_BURST_PER_OWNER):
        q.generation("alice", "10.0.0.1")
    with pytest.raises(Limited, match="from this browser") as e:
        q.generation("alice", "10.0.0.1")
    assert e.value.retry_after_s >= 1
    q.generation("bob", "10.0.0.1")  # another owner from the same address still may
    left = quota.GENERATE_BURST_PER_ADDRESS - quota.GENERATE_BURST_PER_OWNER - 1
    owners = [f"owner-{i}" for i in range(left + 5)]
    refused = 0
    for o in owners:  # made-up owners from one address share the address's allowance
        try:
            q.generation(o, "10.0.0.1")
        except Limited as e:
            assert "from this address" in str(e)
            refused += 1
    assert refused == 5
    q.generation("carol", "10.0.0.2")


def test_an_address_opens_new_pages_at_a_bounded_rate():
    q = Quota()
    for _ in range(quota.PAGES_BURST_PER_ADDRESS):
        q.new_page("10.0.0.1")
    with pytest.raises(Limited, match="new pages from this address"):
        q.new_page("10.0.0.1")
    q.new_page("10.0.0.2")


def test_sandbox_runs_go_one_at_a_time_per_owner():
    q = Quota()
    with q.sandbox_run("alice", "10.0.0.1"):
        with pytest.raises(Limited, match="One test run at a time"):
            with q.sandbox_run("alice", "10.0.0.1"):
                pass
        with q.sandbox_run("bob", "10.0.0.1"):
            with pytest.raises(Limited, match="from one address"):
                with q.sandbox_run("carol", "10.0.0.1"):
                    pass
    with q.sandbox_run("alice", "10.0.0.1"):  # the first one ended
        pass


def test_a_page_id_belongs_to_its_first_owner():
    pages = PageOwners(capacity=2)
    assert pages.claim("p1", "alice") == (True, True) and pages.claim("p1", "alice") == (True, False)
    assert not pages.claim("p1", "bob")[0] and not pages.claim("p1", None)[0]
    assert pages.claim("p2", None)[0] and not pages.claim("p2", "alice")[0]  # an anonymous page stays anonymous
    assert page_ids("/gradio_api/heartbeat/abc", {}, None) == {"abc"}
    assert page_ids("/gradio_api/queue/join", {"session_hash": "q"}, {"session_hash": "b"}) == {"q", "b"}
    assert page_ids("/gradio_api/stream/evt/close", {}, None) == set()  # an event id, not a page
    assert heartbeat_page("/gradio_api/heartbeat/abc") == "abc" and heartbeat_page("/gradio_api/config") is None


def test_the_sweep_forgets_idle_script_pages_and_closed_tabs_but_not_open_ones():
    now = datetime.datetime(2026, 1, 1, 12, 0, 0)
    ago = lambda s: now - datetime.timedelta(seconds=s)  # noqa: E731
    import threading
    holder = SimpleNamespace(lock=threading.Lock(), session_data={}, time_last_used={})
    for page, idle, closed in [("script-old", 120, False), ("script-new", 5, False), ("tab-open", 3600, False),
                               ("tab-closed-old", 3600, True), ("tab-closed-new", 60, True), ("busy", 600, False)]:
        holder.session_data[page] = SimpleNamespace(is_closed=closed)
        holder.time_last_used[page] = ago(idle)
    blocks = SimpleNamespace(state_holder=holder, _queue=SimpleNamespace(pending_event_ids_session={"busy": {"e"}}))
    reaper = PageReaper(blocks)
    reaper.heartbeats |= {"tab-open", "tab-closed-old", "tab-closed-new"}
    assert reaper.reap(now) == 2
    assert set(holder.session_data) == {"script-new", "tab-open", "tab-closed-new", "busy"}
