"""The Playground's run as the page gets it, against the tiny in-process server of the Side by side tests:
the page sees "done" only once the run is stored, in the same update as its session."""
import asyncio

from laneplay.app.playground import Playground, editor_code, session_title
from laneplay.storage import OPERATOR

from .test_sidebyside import OWNER, engine, sbs_context  # noqa: F401  (the module's server fixture)


def frames_of(ctx, speculative: bool) -> list:
    tab, frames = Playground(ctx), []
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 3, "seed": 0}

    async def go():
        async for v in tab._generate(tab.pages.begin(("me", "page")), "def add(a, b):\n", "Write add.", "chat",
                                     params, None, OWNER, True, speculative):
            frames.append(v)
    asyncio.run(go())
    return frames


def test_done_comes_once_with_the_stored_session_and_the_whole_text(engine):  # noqa: F811
    ctx = sbs_context(engine, {"laneplay": True, "device": "cpu", "model": "m"})
    for speculative in (True, False):
        frames = frames_of(ctx, speculative)
        done = [f for f in frames if 'data-state="done"' in f.meter]
        assert len(done) == 1 and done[0] is frames[-1], [f.meter[:80] for f in frames]
        assert all(f.sid is None for f in frames[:-1])  # nothing before it claims a session
        last = frames[-1]
        assert last.text == "S0.0 S0.1 S0.2 " and last.sid and last.last["state"] == "done"
        (gen,) = ctx.store.get_session(last.sid, owner=OPERATOR)["generations"]
        assert gen["text"] == last.text  # Share or History right after "done" find it


def test_a_sessions_title_is_the_first_line_of_what_the_model_was_asked():
    assert session_title("\n\ndef f(x):\n    pass\n", "Add type hints.", "complete") == "def f(x):"
    assert session_title("def f(x):\n", "\n  Add type hints.\nAnd a docstring.", "chat") == "Add type hints."
    assert session_title("def f(x):\n", "   ", "chat") == "def f(x):"  # nothing asked: the other one
    assert session_title("", "", "complete") == "Untitled session"
    assert session_title("x = " + "1" * 100, "", "complete") == "x = " + "1" * 76 + "…"


def test_insert_puts_the_answers_code_in_the_editor():
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."
    assert editor_code("chat", "def add(a, b):\n", "Write add.", answer) == "def add(a, b):\n    return a + b\n"
    assert editor_code("complete", "def add(a, b):\n", "", "    return a + b\n") == "def add(a, b):\n    return a + b\n"


def test_each_output_keeps_what_it_was_asked_on_the_share_page_and_in_a_fork(engine):  # noqa: F811
    from laneplay.app.playground import save_batch
    from laneplay.app.web import share_page

    ctx = sbs_context(engine, {"laneplay": True, "device": "cpu", "model": "m"})
    info = {"model": "m", "device": "cpu", "world_size": 1}

    def record(text):
        return {"sample_index": 0, "text": text, "prompt_tokens": 5, "completion_tokens": 2, "seed": 0,
                "temperature": 0.0}

    sid, _ = save_batch(ctx, None, OWNER, "def f(x):\n    return x\n", "Add type hints.", info, [record("one")])
    save_batch(ctx, sid, OWNER, "def f(x):\n    return x\n", "Add a docstring.", info, [record("two")])
    save_batch(ctx, sid, OWNER, "def g(y):\n", "", info, [record("three")], mode="complete")
    first, second, third = ctx.store.get_session(sid, owner=OWNER)["generations"]
    assert (first["instruction"], second["instruction"], third["mode"]) == ("Add type hints.", "Add a docstring.",
                                                                           "complete")
    token, _ = ctx.store.share_session(sid, owner=OWNER)
    snap = ctx.store.get_shared(token)
    kept = [{k for k in ("mode", "instruction", "code") if k in g} for g in snap["generations"]]
    assert kept == [{"mode", "instruction", "code"}, {"mode", "instruction", "code"}, set()]  # the latest: the session's
    page = share_page(token, snap)
    assert page.count("class='lp-asked'") == 2 and "Add type hints." in page and "Add a docstring." in page
    assert page.index("Output 3") < page.index("three") < page.index("Output 2") < page.index("Add a docstring.")
    forked = ctx.store.fork_shared(token, owner=OWNER)
    copies = ctx.store.get_session(forked, owner=OWNER)["generations"]
    assert [(g["mode"], g["instruction"], g["code"]) for g in copies] == [
        (g["mode"], g["instruction"], g["code"]) for g in (first, second, third)]
