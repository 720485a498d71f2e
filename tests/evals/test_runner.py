"""The pass@N runner with a fake model that returns right, wrong and looping solutions."""
import json
import os

import pytest

from laneplay.evals.passk import pass_at_k
from laneplay.evals.problems import select
from laneplay.evals.runner import EvalConfig, run_eval, worker_count, write_samples_jsonl, write_summary_json

WRONG, LOOP = "    return None\n", "    while True:\n        pass\n"


class FakeModel:
    """Greedy: the canonical solution. Samples: canonical for even indices, wrong for odd ones."""

    def __init__(self, problems, chat=False, loop_task=None):
        self.by_prompt = {p.prompt: p for p in problems}
        self.chat, self.loop_task, self.calls = chat, loop_task, []

    def __call__(self, prompt, n, temperature, seed, max_tokens):
        self.calls.append((type(prompt).__name__, n, temperature, seed, max_tokens))
        if self.chat:
            p = next(p for text, p in self.by_prompt.items() if text.strip() in prompt[0]["content"])
        else:
            p = self.by_prompt[prompt]
        right = p.canonical_solution + "\n\ndef unrelated():\n    pass\n"  # the tail is cut in base mode
        if temperature == 0:
            texts = [right]
        else:
            texts = [right if i % 2 == 0 else (LOOP if p.task_id == self.loop_task and i == 1 else WRONG)
                     for i in range(n)]
        if self.chat:
            texts = [f"Here you go:\n```python\n{p.prompt}{t}```\nDone." for t in texts]
        return texts


def test_base_mode_pass_at_k_and_outputs(tmp_path, sandboxed):
    problems = select("humaneval:0-3")
    model = FakeModel(problems, loop_task="HumanEval/1")
    config = EvalConfig(n_samples=4, temperature=0.8, seed=7, max_tokens=64, timeout_s=2.0, workers=2)
    seen = []
    result = run_eval(problems, model, config, on_sample=seen.append)

    assert model.calls[:2] == [("str", 1, 0.0, 7, 64), ("str", 4, 0.8, 7, 64)]
    assert len(seen) == 3 * 5
    assert result.greedy_pass_at_1 == 1.0
    assert result.pass_at == pytest.approx({k: pass_at_k(4, 2, k) for k in (1, 2, 4)})  # 2 of 4 pass everywhere
    assert result.counts == {"pass": 6, "fail": 5, "timeout": 1, "memory": 0, "error": 0}
    assert result.greedy_counts["pass"] == 3
    p1 = result.problems[1]
    assert (p1.task_id, p1.n, p1.c) == ("HumanEval/1", 4, 2)
    assert p1.samples[1].status == "timeout"
    assert all(r.method == "completion" and "unrelated" not in r.code for r in p1.samples)
    assert result.generation_seconds >= 0 and result.execution_seconds > 0
    assert result.wall_seconds >= result.generation_seconds

    samples, summary = tmp_path / "samples.jsonl", tmp_path / "summary.json"
    write_samples_jsonl(result, str(samples))
    write_summary_json(result, str(summary))
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 15 and rows[0]["kind"] == "greedy" and rows[1]["kind"] == "sample"
    assert {"task_id", "index", "completion", "code", "method", "status", "error", "seconds"} <= set(rows[0])
    s = json.loads(summary.read_text())
    assert s["pass_at"]["pass@1"] == pytest.approx(0.5) and s["greedy_pass@1"] == 1.0
    assert s["per_problem"][1]["counts"]["timeout"] == 1 and s["config"]["n_samples"] == 4


def test_instruct_mode(sandboxed):
    problems = select("humaneval:HumanEval/38,HumanEval/2")
    model = FakeModel(problems, chat=True)
    result = run_eval(problems, model, EvalConfig(mode="instruct", n_samples=2, workers=1))
    assert model.calls[0][0] == "list"
    assert result.greedy_pass_at_1 == 1.0 and result.pass_at[1] == 0.5
    assert all(r.method == "fenced" for p in result.problems for r in p.samples)


def test_greedy_only_and_validation(sandboxed):
    problems = select("humaneval:0")
    result = run_eval(problems, FakeModel(problems), EvalConfig(n_samples=0))
    assert result.pass_at == {} and result.greedy_pass_at_1 == 1.0
    for bad in [EvalConfig(mode="chat"), EvalConfig(n_samples=17), EvalConfig(n_samples=0, greedy=False),
                EvalConfig(temperature=0.0)]:
        with pytest.raises(ValueError):
            run_eval(problems, FakeModel(problems), bad)
    with pytest.raises(RuntimeError, match="expected 1"):
        run_eval(problems, lambda prompt, **kw: [], EvalConfig(n_samples=0))


def test_workers_never_exceed_cores():
    cores = os.cpu_count() or 1
    assert worker_count(None) == cores and worker_count(10_000) == cores and worker_count(1) == 1


def test_refuses_before_generating_without_a_sandbox(monkeypatch):
    from laneplay.evals import sandbox

    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "sandbox_available", lambda: (False, "no bwrap; install bubblewrap"))
    problems = select("humaneval:0")
    model = FakeModel(problems)
    with pytest.raises(sandbox.SandboxUnavailable, match="install bubblewrap"):
        run_eval(problems, model, EvalConfig(n_samples=2))
    assert model.calls == []
