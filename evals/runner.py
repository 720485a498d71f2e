"""pass@N over a list of problems: generate greedy + N samples per problem, check them, tabulate.

Generation runs in the caller's thread, one problem after another; checks run in a bounded worker pool
at the same time (a problem's samples are checked while the next problem is being generated).
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

from laneplay.evals.execution import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S, check
from laneplay.evals.passk import KS, count_statuses, mean_pass_at_ks, pass_at_ks
from laneplay.evals.problems import Problem
from laneplay.evals.prompting import chat_messages, completion_prompt, extract_code, extract_completion
from laneplay.evals.sandbox import require_sandbox

MAX_SAMPLES = 16


class Generate(Protocol):
    """The model: `prompt` is a str (base mode) or a chat message list (instruct mode)."""

    def __call__(self, prompt: str | list[dict[str, str]], n: int, temperature: float,
                 seed: int | None, max_tokens: int) -> list[str]: ...


@dataclass
class EvalConfig:
    mode: str = "base"  # "base" (completion) or "instruct" (chat)
    n_samples: int = 16  # the sampled pool (0: greedy only)
    temperature: float = 0.8  # for the pool; greedy is always temperature 0
    greedy: bool = True
    seed: int | None = 0
    max_tokens: int = 512
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB
    workers: int | None = None  # sandbox checks in parallel; None: all cores; never more than os.cpu_count()

    def validate(self) -> None:
        if self.mode not in ("base", "instruct"):
            raise ValueError(f"mode must be 'base' or 'instruct' (got {self.mode!r})")
        if not 0 <= self.n_samples <= MAX_SAMPLES:
            raise ValueError(f"n_samples must be in [0, {MAX_SAMPLES}]")
        if self.n_samples == 0 and not self.greedy:
            raise ValueError("nothing to do: n_samples is 0 and greedy is off")
        if not 0.0 < self.temperature <= 2.0 and self.n_samples:
            raise ValueError("temperature must be in (0, 2] for sampling")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass
class SampleRecord:
    task_id: str
    kind: str  # "greedy" or "sample"
    index: int
    completion: str  # what the model returned
    code: str  # the candidate program that was checked
    method: str  # how the code was extracted (see prompting.Extraction)
    warnings: list[str]
    status: str  # see passk.OUTCOMES
    error: str
    seconds: float  # execution (sandbox) time


@dataclass
class ProblemResult:
    task_id: str
    greedy: SampleRecord | None
    samples: list[SampleRecord]
    pass_at: dict[int, float]  # from the sampled pool
    counts: dict[str, int]  # outcomes of the sampled pool
    generation_seconds: float
    execution_seconds: float

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def c(self) -> int:
        return sum(s.status == "pass" for s in self.samples)


@dataclass
class EvalResult:
    config: EvalConfig
    problems: list[ProblemResult]
    pass_at: dict[int, float]  # mean over problems
    greedy_pass_at_1: float | None
    counts: dict[str, int]  # all sampled outcomes
    greedy_counts: dict[str, int] | None
    generation_seconds: float  # summed time inside generate()
    execution_seconds: float  # summed sandbox time of all checks (they overlap when workers > 1)
    wall_seconds: float

    def summary(self) -> dict:
        return {
            "config": asdict(self.config),
            "problems": len(self.problems),
            "pass_at": {f"pass@{k}": v for k, v in self.pass_at.items()},
            "greedy_pass@1": self.greedy_pass_at_1,
            "counts": self.counts,
            "greedy_counts": self.greedy_counts,
            "generation_seconds": self.generation_seconds,
            "execution_seconds": self.execution_seconds,
            "wall_seconds": self.wall_seconds,
            "per_problem": [{"task_id": p.task_id, "n": p.n, "c": p.c,
                             "pass_at": {f"pass@{k}": v for k, v in p.pass_at.items()},
                             "greedy": p.greedy.status if p.greedy else None,
                             "counts": p.counts, "generation_seconds": p.generation_seconds,
                             "execution_seconds": p.execution_seconds} for p in self.problems],
        }


def worker_count(requested: int | None) -> int:
    cores = os.cpu_count() or 1
    return max(1, min(requested or cores, cores))


def run_eval(problems: list[Problem], generate: Generate, config: EvalConfig | None = None,
             on_sample: Callable[[SampleRecord], None] | None = None) -> EvalResult:
    """Greedy + N samples for each problem, each checked in the sandbox; pass@k over the pool.

    `on_sample` is called from the checking threads as each sample's outcome is known.
    """
    config = config or EvalConfig()
    config.validate()
    if not problems:
        raise ValueError("no problems to evaluate")
    require_sandbox()  # before any generation: refusing late would waste the model's time
    start = time.monotonic()
    pending: list[tuple[Problem, float, list[tuple[str, int, str, Future]]]] = []
    with ThreadPoolExecutor(max_workers=worker_count(config.workers)) as pool:

        def submit(problem: Problem, kind: str, texts: list[str]) -> list[tuple[str, int, str, Future]]:
            return [(kind, i, text, pool.submit(_check_one, problem, kind, i, text, config, on_sample))
                    for i, text in enumerate(texts)]

        try:
            for problem in problems:
                prompt = completion_prompt(problem) if config.mode == "base" else chat_messages(problem)
                gen_seconds, jobs = 0.0, []
                if config.greedy:
                    t = time.monotonic()
                    texts = _generate(generate, prompt, 1, 0.0, config)
                    gen_seconds += time.monotonic() - t
                    jobs += submit(problem, "greedy", texts)
                if config.n_samples:
                    t = time.monotonic()
                    texts = _generate(generate, prompt, config.n_samples, config.temperature, config)
                    gen_seconds += time.monotonic() - t
                    jobs += submit(problem, "sample", texts)
                pending.append((problem, gen_seconds, jobs))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # a failed or cancelled run checks nothing more
            raise

        results = []
        for problem, gen_seconds, jobs in pending:
            records = [f.result() for _, _, _, f in jobs]
            greedy = next((r for r in records if r.kind == "greedy"), None)
            samples = [r for r in records if r.kind == "sample"]
            c = sum(r.status == "pass" for r in samples)
            results.append(ProblemResult(problem.task_id, greedy, samples,
                                         pass_at_ks(len(samples), c, KS) if samples else {},
                                         count_statuses(r.status for r in samples), gen_seconds,
                                         sum(r.seconds for r in records)))

    sampled = [p for p in results if p.samples]
    greedies = [p.greedy for p in results if p.greedy]
    return EvalResult(
        config, results,
        mean_pass_at_ks([(p.n, p.c) for p in sampled], KS) if sampled else {},
        sum(g.status == "pass" for g in greedies) / len(greedies) if greedies else None,
        count_statuses(r.status for p in results for r in p.samples),
        count_statuses(g.status for g in greedies) if greedies else None,
        sum(p.generation_seconds for p in results), sum(p.execution_seconds for p in results),
        time.monotonic() - start)


def _generate(generate: Generate, prompt, n: int, temperature: float, config: EvalConfig) -> list[str]:
    texts = generate(prompt, n=n, temperature=temperature, seed=config.seed, max_tokens=config.max_tokens)
    if len(texts) != n or not all(isinstance(t, str) for t in texts):
        raise RuntimeError(f"generate() returned {len(texts)} item(s) for n={n}; expected {n} strings")
    return list(texts)


def _check_one(problem: Problem, kind: str, index: int, text: str, config: EvalConfig,
               on_sample: Callable[[SampleRecord], None] | None) -> SampleRecord:
    ex = extract_completion(problem, text) if config.mode == "base" else extract_code(problem, text)
    out = check(problem, ex.code, timeout_s=config.timeout_s, memory_mb=config.memory_mb)
    record = SampleRecord(problem.task_id, kind, index, text, ex.code, ex.method, ex.warnings,
                          out.status, out.error, out.seconds)
    if on_sample:
        on_sample(record)
    return record


def write_samples_jsonl(result: EvalResult, path: str) -> None:
    """One JSON line per checked sample (greedy first), enough to recompute every number."""
    with open(path, "w", encoding="utf-8") as f:
        for p in result.problems:
            for r in ([p.greedy] if p.greedy else []) + p.samples:
                f.write(json.dumps(asdict(r)) + "\n")


def write_summary_json(result: EvalResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.summary(), f, indent=2)
        f.write("\n")
