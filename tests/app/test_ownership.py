"""Ownership as a hostile client probes it: every Gradio event the app registers and every HTTP route it
serves, called with another owner's ids by (a) another owner, (b) no cookie, (c) forged cookies, and (d) the
owner's own page id with each of those cookies. Nothing of the owner's comes back and nothing of it changes.
The events and routes are read from the running app, so a new one is covered without editing this file.
Also: forged and tampered cookies are replaced, rotated keys keep owners, and the limits hold."""
from __future__ import annotations

import gc
import json
import os
import re
import secrets
import time

import httpx
import psutil
import pytest
from starlette.routing import Mount, WebSocketRoute

from laneplay.app import quota
from laneplay.app.context import AppContext
from laneplay.app.owners import COOKIE, OwnerKeys
from laneplay.app.supervisor import RemoteEngine
from laneplay.app.web import create_app
from laneplay.storage import OPERATOR, Store

from .hostile import GradioPage, backend_dependencies, scripted_engine, select_event, trigger_kind
from .serving import serve

SECRET = "owners-data-" + secrets.token_hex(8)  # in every text field of the owner's session, run and link


@pytest.fixture(scope="module")
def app_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ownership")
    store = Store(f"sqlite:///{tmp / 'app.db'}")
    keys = OwnerKeys(tmp / "owner-keys.json")
    with serve(scripted_engine()) as engine_url:
        engine = RemoteEngine(engine_url)
        ctx = AppContext(engine=engine, store=store, owners=keys)
        app = create_app(ctx)
        engine.start()
        deadline = time.monotonic() + 30
        while not engine.ready:
            assert time.monotonic() < deadline, engine.detail
            time.sleep(0.05)
        with serve(app) as url:
            config = httpx.get(url + "/config", timeout=10).json()
            yield {"url": url, "ctx": ctx, "app": app, "config": config, "keys": keys, "store": store}
        engine.stop()
    store.close()


def new_cookie(url: str) -> str:
    r = httpx.get(url + "/", timeout=30)
    return r.cookies[COOKIE]


@pytest.fixture(scope="module")
def victim(app_server):
    """An owner with a session (code, instruction, title, an output), a share link and a finished pass@N run,
    every text carrying SECRET; and that owner's page, opened on the session."""
    url, store, keys = app_server["url"], app_server["store"], app_server["keys"]
    cookie = new_cookie(url)
    owner = keys.read(cookie)[0]
    sid = store.create_session(title=f"title {SECRET}", code=f"# code {SECRET}\n", instruction=f"do {SECRET}",
                               params={"temperature": 0.0}, owner=owner)
    store.add_generations(sid, [{"sample_index": 0, "text": f"output {SECRET}", "prompt_tokens": 3,
                                 "completion_tokens": 2}], owner=owner)
    store.share_session(sid, owner=owner)
    link = store.list_shares(sid, owner=owner)[0]["link"]
    run = store.create_comparison(session_id=sid, problem_set="user", problem_ids=["user/0"], n=1,
                                  temperature=0.5, tests=[f"assert '{SECRET}'"], settings={"prompt": f"# {SECRET}"},
                                  owner=owner)
    store.add_sample_results(run, [{"problem_id": "user/0", "sample_index": 0, "status": "fail",
                                    "error": f"AssertionError {SECRET}", "code": f"x = '{SECRET}'"}], owner=owner)
    store.set_passk(run, {1: 0.0}, owner=owner)
    page = GradioPage(url, app_server["config"], cookie, query=f"?session={sid}")
    seen = prime(page, sid, run)
    assert SECRET in seen, "the owner's own page must see its session (else this test proves nothing)"
    yield {"cookie": cookie, "owner": owner, "sid": sid, "run": run, "link": link, "page": page}
    page.close()


def by_name(config: dict, pattern: str) -> list[dict]:
    return [d for d in backend_dependencies(config) if re.fullmatch(pattern, d.get("api_name") or "")]


def prime(page: GradioPage, sid: str, run: str) -> str:
    """What an owner's page does: load (opening the session), open each tab (lists), select the session's
    History row and the run. Returns everything it was answered."""
    seen = []
    steps = [("on_load(_\\d+)?", "", None), ("refresh(_\\d+)?", "", None), ("pick", "", select_event()),
             ("pick_run", "", select_event()), ("open_run", run, None)]
    for pattern, choice, event in steps:
        for dep in by_name(page.config, pattern):
            data = [page.value_for(i, sid, choice) for i in dep["inputs"]]
            seen.append(page.call(dep, data, event).text)
    return "\n".join(seen)


def snapshot(store: Store, sid: str, run: str) -> dict:
    s = store.get_session(sid, owner=OPERATOR)
    c = store.get_comparison(run, owner=OPERATOR)
    return {"session": s and {k: s[k] for k in ("title", "code", "instruction", "params", "updated_at")},
            "outputs": s and [g["text"] for g in s["generations"]], "tests": s and [g["test_status"] for g in
                                                                                  s["generations"]],
            "links": [x["link"] for x in store.list_shares(sid, owner=OPERATOR)],
            "run": c and (c["status"], len(c["results"]), c["finished_at"])}


def forged_cookies(keys: OwnerKeys, cookie: str, owner: str) -> list[str]:
    """Cookies a hostile client can make: the owner id unsigned, the cookie with one character of its
    signature changed, a different owner id under the owner's signature, and a made-up value."""
    i = len(cookie) - 3
    tampered = cookie[:i] + ("A" if cookie[i] != "A" else "B") + cookie[i + 1:]
    other_id = secrets.token_urlsafe(32)
    return [owner, tampered, other_id + cookie[cookie.rindex("."):], "x" * 43 + ".y"]


def attackers(app_server, victim) -> list[tuple[str, str | None, str | None]]:
    """(label, cookie, page id): (a) another owner, (b) no cookie, (c) forged cookies, each on a page of its
    own, then (d) each of them on the owner's page."""
    url, keys = app_server["url"], app_server["keys"]
    other = new_cookie(url)
    forged = forged_cookies(keys, victim["cookie"], victim["owner"])
    cookies = [("another owner", other), ("no cookie", None), ("the owner's id unsigned", forged[0]),
               ("the owner's cookie tampered", forged[1])]
    for label, c in cookies[2:]:
        assert keys.read(c)[0] is None, label
    return [(label, c, None) for label, c in cookies] + \
        [(f"{label} on the owner's page", c, victim["page"].session_hash) for label, c in cookies]


def test_no_event_answers_or_changes_anything_of_another_owner(app_server, victim):
    config, store = app_server["config"], app_server["store"]
    sid, run, link = victim["sid"], victim["run"], victim["link"]
    before = snapshot(store, sid, run)
    deps = backend_dependencies(config)
    deps = sorted(deps, key=lambda d: trigger_kind(d) != "load")  # a page loads first (it may open ?session=)
    assert len(deps) >= 40, "the app registers more events than this found"
    called, leaks = 0, []
    for label, cookie, page_id in attackers(app_server, victim):
        page = GradioPage(app_server["url"], config, cookie, session_hash=page_id, query=f"?session={sid}")
        try:
            for dep in deps:  # the page loads (and tries to open the owner's session) before the rest
                if trigger_kind(dep) == "load":
                    page.call(dep, [])
            calls, given = [], []
            for dep in deps:
                event = select_event() if trigger_kind(dep) == "select" else None
                for strings, choice in ((sid, run), (run, link)):
                    calls.append((dep, [page.value_for(i, strings, choice) for i in dep["inputs"]], event))
                    given.append((dep.get("api_name"), strings, choice))
            for reply, (name, strings, choice) in zip(page.call_many(calls), given):
                called += 1
                if SECRET in reply.text or (link not in (strings, choice) and link[:8] in reply.text):
                    leaks.append(f"{label}: {name} answered the owner's data")
        finally:
            page.close()
    assert not leaks, leaks
    assert called >= len(deps) * 2 * 8
    assert snapshot(store, sid, run) == before
    # The same events do reach the session for its owner (so the ones above were refused, not broken).
    owner_page = victim["page"]
    [rename] = by_name(config, "rename")
    owner_page.call(rename, [None, "renamed by its owner"])
    assert store.get_session(sid, owner=OPERATOR)["title"] == "renamed by its owner"


def routes(app, prefix: str = ""):
    """(path template, methods) of every HTTP route, mounted apps included."""
    for r in app.routes:
        if isinstance(r, WebSocketRoute):
            continue
        included = getattr(r, "original_router", None)  # FastAPI's include_router (Gradio's API routes)
        if included is not None:
            yield from routes(included, prefix + r.include_context.prefix)
            continue
        if isinstance(r, Mount):
            if hasattr(r.app, "routes"):
                yield from routes(r.app, prefix + r.path)
            else:  # static files: one file name stands for them all
                yield prefix + r.path + "/{file}", {"GET"}
            continue
        methods = getattr(r, "methods", None) or {"GET"}
        yield prefix + r.path, methods


def test_no_http_route_answers_anything_of_another_owner(app_server, victim):
    url, store = app_server["url"], app_server["store"]
    sid, run, link = victim["sid"], victim["run"], victim["link"]
    before = snapshot(store, sid, run)
    # Every request below names a new page id; lift the new-page limit so each one reaches its route.
    app_server["ctx"].quota.pages = quota.Rate(10**9, 10**9, "pages")
    found = sorted(set((p, m) for p, ms in routes(app_server["app"]) for m in ms if m in ("GET", "POST")))
    paths = {p for p, _ in found}
    assert {"/s/{token}", "/s/{token}/fork", "/api/runs/{run_id}/sample"} <= paths, paths
    checked = 0
    for label, cookie, page_id in attackers(app_server, victim):
        with httpx.Client(base_url=url, timeout=0.5) as client:
            if cookie is not None:
                client.cookies.set(COOKIE, cookie)
            for path, method in found:
                if page_id and not path.startswith("/gradio_api/"):
                    continue  # only Gradio's API knows page ids; elsewhere (d) is (a)-(c) again
                for value in (sid, run, link) if "{" in path else (sid,):
                    target = re.sub(r"\{[^}]+\}", value, path)
                    params = {"session": sid, "session_hash": page_id or secrets.token_hex(6),
                              "problem": "user/0", "greedy": 0, "index": 0, "run": run}
                    body = b""
                    try:
                        with client.stream(method, target, params=params) as r:
                            for chunk in r.iter_bytes():
                                body += chunk
                                if len(body) > 2_000_000:
                                    break
                    except httpx.TransportError:
                        pass  # a stream that waits (the heartbeat), or a route that failed mid-answer:
                        #       what came so far is checked
                    checked += 1
                    assert SECRET.encode() not in body, (label, method, target)
    assert checked >= len(found) * 4
    after = snapshot(store, sid, run)
    # Forks by POST /s/<token>/fork need the token, which no attacker has: nothing changed.
    assert after == before


def test_a_forged_or_tampered_cookie_is_replaced_and_a_rotated_key_keeps_the_owner(app_server, victim):
    url, keys = app_server["url"], app_server["keys"]
    for bad in forged_cookies(keys, victim["cookie"], victim["owner"]):
        r = httpx.get(url + "/", cookies={COOKIE: bad}, timeout=30)
        fresh = r.cookies.get(COOKIE)
        assert fresh and fresh != bad, bad
        owner, current = keys.read(fresh)
        assert owner is not None and owner != victim["owner"] and current
        assert "httponly" in r.headers["set-cookie"].lower() and "samesite=lax" in r.headers["set-cookie"].lower()
    r = httpx.get(url + "/", cookies={COOKIE: victim["cookie"]}, timeout=30)
    assert COOKIE not in r.cookies  # a valid cookie stays as it is
    keys.rotate()
    try:
        r = httpx.get(url + "/", cookies={COOKIE: victim["cookie"]}, timeout=30)
        resigned = r.cookies.get(COOKIE)
        assert resigned and resigned != victim["cookie"] and keys.read(resigned) == (victim["owner"], True)
        assert keys.read(victim["cookie"]) == (victim["owner"], False)  # the older key still verifies
    finally:
        pass
    assert OwnerKeys(keys.path).read(victim["cookie"])[0] == victim["owner"]


def test_rotating_with_drop_old_voids_earlier_cookies(tmp_path):
    keys = OwnerKeys(tmp_path / "keys.json")
    owner, cookie = keys.issue()
    assert keys.read(cookie) == (owner, True)
    assert keys.rotate() == 2 and keys.read(cookie) == (owner, False)
    assert keys.rotate(drop_old=True) == 1 and keys.read(cookie) == (None, False)
    assert oct(os.stat(keys.path).st_mode & 0o777) == "0o600"


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_two_hundred_fast_generate_calls_are_limited_and_memory_comes_back(app_server):
    url, config, store, keys = app_server["url"], app_server["config"], app_server["store"], app_server["keys"]
    app_server["ctx"].quota.pages = quota.Rate(quota.PAGES_BURST_PER_ADDRESS, quota.PAGES_PER_MINUTE_PER_ADDRESS,
                                               "pages")  # as a fresh server has it
    cookie = new_cookie(url)
    owner = keys.read(cookie)[0]
    [generate] = by_name(config, "generate")
    start_mb = rss_mb()
    outcomes = {"done": 0, "limited": 0, "other": [], "status": set()}
    client = httpx.Client(base_url=url, timeout=30.0)
    started = time.monotonic()
    for _ in range(200):  # a replayed call each time: a new page id, no session
        page = GradioPage(url, config, cookie, client=client)
        data = [page.value_for(i, "", "") for i in generate["inputs"]]
        data[0], data[1] = "def f():\n", "Write f."  # code, instruction
        reply = page.call(generate, data)
        page.close()
        if "Too many generations from this browser" in reply.text:  # a script's call: 429 at the door
            outcomes["limited"] += 1
            outcomes["status"].add(reply.messages[0].get("status"))
        elif reply.completed and "lp-error-none" in json.dumps(reply.outputs[2]):
            outcomes["done"] += 1
        else:
            outcomes["other"].append(reply.text[-300:])
    client.close()
    assert not outcomes["other"], outcomes["other"][:2]
    refilled = (time.monotonic() - started) * quota.GENERATE_PER_MINUTE_PER_OWNER / 60
    allowed = quota.GENERATE_BURST_PER_OWNER
    assert allowed <= outcomes["done"] <= allowed + refilled + 1, outcomes  # the burst, and what refilled
    assert outcomes["limited"] == 200 - outcomes["done"] and outcomes["status"] == {429}
    assert len(store.list_sessions(owner=owner)) == outcomes["done"]  # a limited call stores nothing
    # A browser's page (its heartbeat open) over the limit gets the message in the page, not a refused call.
    bucket = app_server["ctx"].quota.gen_owner
    bucket.wait_s(owner)
    bucket._buckets[owner].tokens = -10.0  # nothing refills before the call below, however slow the machine
    page = GradioPage(url, config, cookie)
    try:
        page.client.get(f"/gradio_api/heartbeat/{page.session_hash}", timeout=0.3)
    except httpx.TimeoutException:
        pass  # the heartbeat is a stream that stays open; its start is what marks a browser page
    data = [page.value_for(i, "", "") for i in generate["inputs"]]
    data[0], data[1] = "def f():\n", "Write f."
    reply = page.call(generate, data)
    page.close()
    assert reply.completed and "lp-error" in json.dumps(reply.outputs[2]) and \
        "Too many generations from this browser" in json.dumps(reply.outputs[2])
    reaper = app_server["app"].state.reaper
    reaper.heartbeats.discard(page.session_hash)
    reaper.api_idle_s = 0.0  # what the server's sweep does a minute after the calls end
    time.sleep(0.05)
    assert reaper.reap() >= outcomes["done"]
    assert rss_mb() - start_mb < 50


def test_forget_deletes_this_browsers_sessions_only_and_clears_its_cookie(app_server, victim):
    url, store, keys = app_server["url"], app_server["store"], app_server["keys"]
    cookie = new_cookie(url)
    owner = keys.read(cookie)[0]
    sid = store.create_session(title="to forget", owner=owner)
    theirs = victim["sid"]
    refused = httpx.post(url + "/api/forget", cookies={COOKIE: cookie}, headers={"Origin": "https://elsewhere.example"})
    assert refused.status_code == 403 and store.get_session(sid, owner=owner) is not None
    refused = httpx.post(url + "/api/forget", cookies={COOKIE: cookie}, headers={"Sec-Fetch-Site": "cross-site"})
    assert refused.status_code == 403 and store.get_session(sid, owner=owner) is not None
    r = httpx.post(url + "/api/forget", cookies={COOKIE: cookie}, headers={"Origin": url})
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert f"{COOKIE}=" in r.headers["set-cookie"] and "max-age=0" in r.headers["set-cookie"].lower()
    assert store.get_session(sid, owner=OPERATOR) is None and store.list_sessions(owner=owner) == []
    assert store.get_session(theirs, owner=OPERATOR) is not None


def test_a_body_that_hides_its_size_cannot_slip_a_page_id_past_the_check(app_server, victim):
    payload = json.dumps({"data": [], "event_data": None, "fn_index": 0, "trigger_id": None,
                          "session_hash": victim["page"].session_hash}).encode()
    r = httpx.post(app_server["url"] + "/gradio_api/queue/join", content=iter([payload]),
                   headers={"content-type": "text/plain"}, timeout=10)  # chunked: no Content-Length
    assert r.status_code == 411
    r = httpx.post(app_server["url"] + "/gradio_api/queue/join", content=payload,
                   headers={"content-type": "text/plain"}, timeout=10)  # any content type is read
    assert r.status_code == 403
