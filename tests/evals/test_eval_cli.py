"""`laneplay eval`: the printed table, the stored comparison, --engine-url, Ctrl-C and refusals."""
import json
import re
import socket
import threading
import time

import pytest

from laneplay.evals import cli as eval_cli
from laneplay.evals.engine_generate import Batch, SampleTiming
from laneplay.evals.passk import pass_at_k
from laneplay.evals.problems import select
from laneplay.cli import main
from laneplay.storage import OPERATOR, Store

WRONG = "    return None\n"


def right_or_wrong(problem, i: int, temperature: float) -> str:
    """Greedy and even-numbered samples: the canonical body; odd-numbered samples: a wrong one."""
    return problem.canonical_solution if temperature == 0 or i % 2 == 0 else WRONG


def problem_of(prompt, problems):
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return next(p for p in problems if p.prompt.strip() in text)


def as_answer(problem, body: str, chat: bool) -> str:
    return f"Sure:\n```python\n{problem.prompt}{body}```\n" if chat else body + "\n\ndef unrelated():\n    pass\n"


class StubModel:
    """Stands in for evals.engine_generate.LocalGenerate: canned answers, made-up timings."""
    model, device = "stub-model", "cpu"

    def __init__(self, problems, interrupt_at=None, out=None):
        self.problems, self.batches, self.calls = problems, [], []
        self.interrupt_at, self.out = interrupt_at, out

    def __call__(self, prompt, n, temperature, seed, max_tokens):
        self.calls.append((type(prompt).__name__, n, temperature, seed, max_tokens))
        p = problem_of(prompt, self.problems)
        if p.task_id == self.interrupt_at:  # Ctrl-C once the earlier problems are on disk
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len((self.out / "samples.jsonl").read_text().splitlines()) < 6:
                time.sleep(0.05)
            raise KeyboardInterrupt
        self.batches.append(Batch(n, temperature, 0.5 * n, [SampleTiming(10 + i, 100.0 * (i + 1), 20.0, "stop")
                                                            for i in range(n)]))
        return [as_answer(p, right_or_wrong(p, i, temperature), isinstance(prompt, list)) for i in range(n)]

    def close(self):
        pass


def printed_numbers(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^\s*(pass@\d+|greedy pass@1)\s+([0-9.]+)", out, re.M)}


def check_stored(db_url: str, comparison_id: str, printed: dict[str, float], n: int, problems: int) -> dict:
    """The stored comparison reproduces the printed numbers: pass@k recomputed from its samples."""
    c = Store(db_url).get_comparison(comparison_id, owner=OPERATOR)
    assert c["finished_at"] is not None and c["n"] == n and len(c["problem_ids"]) == problems
    sampled = [r for r in c["results"] if not r["greedy"]]
    greedy = [r for r in c["results"] if r["greedy"]]
    assert len(sampled) == n * problems and len(greedy) == problems
    correct = [sum(r["status"] == "pass" for r in sampled if r["problem_id"] == pid) for pid in c["problem_ids"]]
    stored = {f"pass@{p['k']}": p["value"] for p in c["passk"]}
    assert set(stored) == {f"pass@{k}" for k in (1, 2, 4, 8, 16) if k <= n}
    for k in (1, 2, 4, 8, 16):
        if k <= n:
            recomputed = sum(pass_at_k(n, ci, k) for ci in correct) / problems
            assert stored[f"pass@{k}"] == pytest.approx(recomputed)
            assert printed[f"pass@{k}"] == pytest.approx(recomputed, abs=5e-5)
    greedy_pass1 = sum(r["status"] == "pass" for r in greedy) / problems
    assert c["greedy_pass1"] == pytest.approx(greedy_pass1)
    assert printed["greedy pass@1"] == pytest.approx(greedy_pass1, abs=5e-5)
    assert c["greedy_seconds"] > 0 and c["sampled_seconds"] > 0
    assert all(r["generation_ms"] is not None and r["completion_tokens"] is not None for r in c["results"])
    return c


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'laneplay.db'}"


def comparison_id_of(out: str) -> str:
    return re.search(r"comparison\s+(\S+)", out)[1]


@pytest.mark.parametrize("mode", ["instruct", "base"])
def test_stub_model_table_storage_and_files(mode, tmp_path, db_url, monkeypatch, capsys, sandboxed):
    problems = select("humaneval:0-3")
    stub = StubModel(problems)
    monkeypatch.setattr(eval_cli, "_load_model", lambda args: stub)
    rc = main(["eval", "--problems", "humaneval:0-3", "--n", "4", "--mode", mode, "--seed", "5",
               "--max-tokens", "64", "--workers", "64", "--db", db_url, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert stub.calls[:2] == [("list" if mode == "instruct" else "str", 1, 0.0, 5, 64),
                              ("list" if mode == "instruct" else "str", 4, 0.8, 5, 64)]
    printed = printed_numbers(captured.out)
    assert set(printed) == {"pass@1", "pass@2", "pass@4", "greedy pass@1"}  # k <= n only
    assert printed["pass@1"] == pytest.approx(0.5) and printed["greedy pass@1"] == 1.0
    assert "pass 6  fail 6" in captured.out and "4 samples take 4.0x the greedy call's time" in captured.out
    assert "capped at" in captured.err  # --workers 64 on a machine with fewer cores
    assert len(re.findall(r"^\[\d/3\] HumanEval/\d", captured.err, re.M)) == 3  # one progress line per problem
    cid = comparison_id_of(captured.out)
    c = check_stored(db_url, cid, printed, n=4, problems=3)
    assert c["model"] == "stub-model" and c["problem_set"] == "humaneval:0-3"
    assert c["greedy_seconds"] == pytest.approx(1.5) and c["sampled_seconds"] == pytest.approx(6.0)

    lines = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 15 and lines[0]["kind"] == "greedy" and lines[1]["completion_tokens"] == 10
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["comparison_id"] == cid and summary["latency"]["sample"]["seconds_per_problem"] == 2.0
    assert summary["pass_at"]["pass@4"] == pytest.approx(printed["pass@4"], abs=5e-5)


def test_greedy_only(tmp_path, db_url, monkeypatch, capsys, sandboxed):
    problems = select("humaneval:0-2")
    monkeypatch.setattr(eval_cli, "_load_model", lambda args: StubModel(problems))
    rc = main(["eval", "--problems", "humaneval:0-2", "--n", "0", "--db", db_url, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and printed_numbers(out) == {"greedy pass@1": 1.0}
    c = Store(db_url).get_comparison(comparison_id_of(out), owner=OPERATOR)
    assert c["greedy_pass1"] == 1.0 and c["passk"] == [] and len(c["results"]) == 2
    assert c["n"] == 0 and c["greedy"] is True  # stored as what it is: greedy only, no samples
    assert all(r["greedy"] for r in c["results"])


def test_ctrl_c_keeps_finished_problems(tmp_path, db_url, monkeypatch, capsys, sandboxed):
    problems = select("humaneval:0-4")
    out_dir = tmp_path / "out"
    monkeypatch.setattr(eval_cli, "_load_model",
                        lambda args: StubModel(problems, interrupt_at="HumanEval/2", out=out_dir))
    rc = main(["eval", "--problems", "humaneval:0-4", "--n", "2", "--db", db_url, "--out", str(out_dir)])
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted; 2 of 4 problems are stored" in err
    cid = re.search(r"comparison (\S+) \(left unfinished\)", err)[1]
    c = Store(db_url).get_comparison(cid, owner=OPERATOR)
    assert c["finished_at"] is None and c["passk"] == []
    assert sorted({r["problem_id"] for r in c["results"]}) == ["HumanEval/0", "HumanEval/1"]
    assert len(c["results"]) == 2 * 3


def test_unknown_problem_set(capsys, db_url):
    assert main(["eval", "--problems", "mbpp:0-3", "--db", db_url]) == 2
    err = capsys.readouterr().err
    assert "unknown problem set 'mbpp:0-3'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [(["--n", "17"], "--n must be in [0, 16]"),
                                           (["--top-p", "0"], "--top-p must be in (0, 1]"),
                                           (["--n", "0", "--no-greedy"], "nothing to do")])
def test_bad_options(argv, message, capsys, db_url):
    assert main(["eval", "--problems", "humaneval:0-1", "--db", db_url, *argv]) == 2
    assert message in capsys.readouterr().err


def test_refuses_without_sandbox(monkeypatch, capsys, db_url):
    from laneplay.evals import sandbox

    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "sandbox_available", lambda: (False, "bubblewrap is not installed"))
    monkeypatch.setattr(eval_cli, "_load_model", lambda args: pytest.fail("the model must not load"))
    assert main(["eval", "--problems", "humaneval:0-2", "--db", db_url]) == 2
    assert "refusing to run generated code: bubblewrap is not installed" in capsys.readouterr().err


# -- --engine-url against a small fake OpenAI-compatible server ------------------------------------

def fake_server(problems, requests: list, owner: str = "someone"):
    """A FastAPI app answering /v1/completions and /v1/chat/completions with canned solutions; its model
    card says `owned_by: owner` (a Laneplay engine says "laneplay")."""
    from fastapi import FastAPI, Request

    app = FastAPI()

    def reply(body, chat):
        requests.append(body)
        p = problem_of(body["messages"] if chat else body["prompt"], problems)
        choices = []
        for i in range(body["n"]):
            text = as_answer(p, right_or_wrong(p, i, body["temperature"]), chat)
            choices.append({"index": i, "finish_reason": "stop",
                            **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})})
        return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": "fake-served",
                "choices": choices[::-1],  # out of order on purpose: index decides
                "usage": {"prompt_tokens": 50, "completion_tokens": 30 * body["n"]},
                "laneplay": {"total_ms": 1.0, "per_choice": [  # the shape engine/server.py answers with
                    {"index": i, "completion_tokens": 30 + i, "total_ms": 40.0 * (i + 1),
                     "decode_tokens_per_second": 75.0} for i in range(body["n"])][::-1]}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-served", "object": "model", "owned_by": owner}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return reply(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return reply(await request.json(), chat=True)

    return app


@pytest.fixture
def served(request):
    """(base URL, the request bodies it saw) of the fake server, running in a thread."""
    import uvicorn

    problems, requests = select("humaneval:0-3"), []
    owner = getattr(request, "param", "someone")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_server(problems, requests, owner), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the fake engine server did not start"
    yield f"http://127.0.0.1:{port}", requests
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("mode", ["instruct", "base"])
def test_engine_url(mode, served, tmp_path, db_url, monkeypatch, capsys, sandboxed):
    url, requests = served
    monkeypatch.setattr("laneplay.engine.load_engine", lambda *a, **k: pytest.fail("no local model with --engine-url"))
    rc = main(["eval", "--problems", "humaneval:0-3", "--n", "2", "--mode", mode, "--top-p", "0.95",
               "--engine-url", url + "/v1", "--db", db_url, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert len(requests) == 6
    greedy, sampled = requests[0], requests[1]
    assert (greedy["n"], greedy["temperature"], greedy["top_p"]) == (1, 0.0, 1.0)
    assert (sampled["n"], sampled["temperature"], sampled["top_p"], sampled["seed"]) == (2, 0.8, 0.95, 0)
    assert ("messages" in sampled) == (mode == "instruct") and ("stop" in sampled) == (mode == "base")
    printed = printed_numbers(captured.out)
    assert printed == {"pass@1": 0.5, "pass@2": 1.0, "greedy pass@1": 1.0}
    c = check_stored(db_url, comparison_id_of(captured.out), printed, n=2, problems=3)
    assert c["model"] == "fake-served"
    assert [(r["completion_tokens"], r["generation_ms"]) for r in c["results"][:3]] == \
        [(30, 40.0), (30, 40.0), (31, 80.0)]


@pytest.mark.parametrize("served", ["laneplay", "someone"], indirect=True)
def test_an_eval_is_batch_work_on_a_laneplay_engine(served, request):
    """On a Laneplay engine an evaluation asks for batch priority (interactive users of the same engine
    go first); other servers never see the extension."""
    from laneplay.evals.engine_generate import RemoteGenerate

    url, requests = served
    gen = RemoteGenerate(url + "/v1")
    gen(select("humaneval:0-1")[0].prompt, n=1, temperature=0.0, seed=0, max_tokens=8)
    ours = request.node.callspec.params["served"] == "laneplay"
    assert gen.ours == ours
    assert [r.get("laneplay") for r in requests] == [{"priority": "batch"} if ours else None]


def test_engine_url_unreachable(capsys, db_url, sandboxed):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    assert main(["eval", "--problems", "humaneval:0-1", "--engine-url", f"http://127.0.0.1:{port}",
                 "--db", db_url]) == 2
    assert f"the engine server at http://127.0.0.1:{port} did not answer" in capsys.readouterr().err


# -- the real default model -----------------------------------------------------------------------

@pytest.mark.slow  # a few minutes on the 2-core machine
def test_default_model_small_run(tmp_path, db_url, capsys, sandboxed):
    rc = main(["eval", "--problems", "humaneval:0-2", "--n", "2", "--max-tokens", "40", "--no-compile",
               "--db", db_url, "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    printed = printed_numbers(captured.out)
    assert set(printed) == {"pass@1", "pass@2", "greedy pass@1"}
    c = check_stored(db_url, comparison_id_of(captured.out), printed, n=2, problems=2)
    assert c["model"] and all(r["completion_tokens"] >= 1 for r in c["results"])
    assert re.search(r"mean decode [0-9.]+ tokens/s", captured.out)
