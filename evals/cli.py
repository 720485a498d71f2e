"""`laneplay eval`: pass@N of a model over a problem set, with what the extra samples cost in latency.

For every problem: one greedy completion and N samples (one generate call each; the N samples share
one prefill), each checked in the sandbox. Each problem is stored as soon as all its checks are done
(database + samples.jsonl), so Ctrl-C keeps every finished problem; the comparison is marked finished,
with pass@k, greedy pass@1 and the generation time of each side, only when the whole run completes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from laneplay.evals.passk import KS, OUTCOMES

PROBLEM_SET_CHARS = 64  # storage.limits.MAX_PROBLEM_SET_CHARS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--problems", required=True,
                   help="humaneval, humaneval:A-B (end exclusive), humaneval:HumanEval/3,... or a .jsonl[.gz] file")
    p.add_argument("--n", type=int, default=16, help="samples per problem, 0-16 (0: greedy only)")
    p.add_argument("--temperature", type=float, default=0.8, help="for the samples; greedy is always 0")
    p.add_argument("--top-p", type=float, default=1.0, help="for the samples")
    p.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                   help="also generate the greedy baseline (pass@1 at temperature 0)")
    p.add_argument("--mode", choices=("instruct", "base"), default="instruct",
                   help="instruct: chat template, code taken from the answer; base: completion with stop sequences")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="sample i of every problem uses seed + i")
    p.add_argument("--workers", type=int, default=None, help="sandbox checks in parallel (default and cap: the cores)")
    p.add_argument("--model", default=None, help="checkpoint to load (default: the engine's embedded default "
                   "model); with --engine-url, the model name sent to the server (default: the server's model)")
    p.add_argument("--engine-url", default=None, help="use an engine server (OpenAI-compatible API) instead of "
                   "loading the model here, e.g. http://127.0.0.1:8000")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8", "int4"),
                   help="weights: auto (int4 on the CPU), float32 (exact), bfloat16, float16, int8, int4")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the CPU decode step (faster decode, about a minute of warm-up)")
    p.add_argument("--out", default=None, help="folder for samples.jsonl and summary.json "
                   "(default: $LANEPLAY_DATA_DIR or ./data, then evals/<timestamp>/)")
    p.add_argument("--db", default=None, help="database URL (default: $LANEPLAY_DATABASE_URL, else the "
                   "SQLite file in $LANEPLAY_DATA_DIR or ./data)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per check")
    p.add_argument("--memory-mb", type=int, default=1024, help="per check")


def _fail(message: str, code: int = 2) -> int:
    print(f"laneplay eval: {message}", file=sys.stderr)
    return code


def _config(args):
    from laneplay.evals.runner import EvalConfig
    from laneplay.evals.sandbox import MAX_TIMEOUT_S

    config = EvalConfig(mode=args.mode, n_samples=args.n, temperature=args.temperature, greedy=args.greedy,
                        seed=args.seed, max_tokens=args.max_tokens, timeout_s=args.timeout_s,
                        memory_mb=args.memory_mb, workers=args.workers)
    if not 0 <= args.n <= 16:
        raise ValueError(f"--n must be in [0, 16] (got {args.n})")
    config.validate()
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (got {args.top_p})")
    if not 0 < args.timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout-s must be in (0, {MAX_TIMEOUT_S:g}] (got {args.timeout_s})")
    if not 64 <= args.memory_mb <= 65536:
        raise ValueError(f"--memory-mb must be in [64, 65536] (got {args.memory_mb})")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {args.workers})")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be >= 0 (got {args.seed})")
    return config


def _out_dir(out: str | None) -> Path:
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = Path(os.environ.get("LANEPLAY_DATA_DIR") or "data") / "evals" / time.strftime("%Y%m%d-%H%M%S")
    for i in range(1, 100):  # two runs started in the same second get their own folders
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise OSError(f"could not create an output folder next to {base}")


class Recorder:
    """Follows a run: pairs each generate() call with its problem and side (greedy or samples), and as
    each problem's checks finish, in problem order, stores it, appends it to samples.jsonl and prints
    a progress line."""

    def __init__(self, problems, config, model, store, comparison_id: str, samples_path: Path):
        self.problems, self.model, self.store, self.comparison_id = problems, model, store, comparison_id
        self.samples_path = samples_path
        # The runner's call order for each problem: the greedy call first, then the N-sample batch.
        self.sides = ([("greedy", 1)] if config.greedy else []) + \
                     ([("sample", config.n_samples)] if config.n_samples else [])
        self.per_problem = sum(n for _, n in self.sides)
        self.batches = {}  # (task_id, side) -> engine_generate.Batch
        self.records = {p.task_id: [] for p in problems}
        self.stored = 0  # problems stored so far: problems[:stored]
        self.lock = threading.Lock()
        self.started = time.monotonic()
        samples_path.write_text("")

    def generate(self, prompt, n, temperature, seed, max_tokens):
        call = len(self.batches)
        problem = self.problems[call // len(self.sides)]
        side, expected = self.sides[call % len(self.sides)]
        if n != expected or (side == "greedy") != (temperature == 0):
            raise RuntimeError(f"unexpected generate call (n={n}, temperature={temperature}) for "
                               f"{problem.task_id}; expected the {side} call")
        texts = self.model(prompt, n, temperature, seed, max_tokens)
        self.batches[(problem.task_id, side)] = self.model.batches[-1]
        return texts

    def on_sample(self, record) -> None:
        with self.lock:
            self.records[record.task_id].append(record)
            while self.stored < len(self.problems) and \
                    len(self.records[self.problems[self.stored].task_id]) == self.per_problem:
                self._store(self.problems[self.stored].task_id)
                self.stored += 1

    def _timing(self, record):
        return self.batches[(record.task_id, record.kind)].samples[record.index]

    def _store(self, task_id: str) -> None:
        from laneplay.storage import OPERATOR  # `laneplay eval` is the operator's tool: its runs are nobody's
        records = sorted(self.records[task_id], key=lambda r: (r.kind != "greedy", r.index))
        self.store.add_sample_results(self.comparison_id, [
            {"problem_id": task_id, "greedy": r.kind == "greedy", "sample_index": r.index, "status": r.status,
             "error": r.error or None, "runtime_s": r.seconds, "completion_tokens": self._timing(r).completion_tokens,
             "generation_ms": self._timing(r).generation_ms} for r in records], owner=OPERATOR)
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps({**asdict(r), **asdict(self._timing(r))}) + "\n")
        greedy = next((r.status for r in records if r.kind == "greedy"), None)
        samples = [r for r in records if r.kind == "sample"]
        parts = [f"[{self.stored + 1}/{len(self.problems)}] {task_id}"]
        if greedy:
            parts.append(f"greedy {greedy} ({self.batches[(task_id, 'greedy')].seconds:.1f} s)")
        if samples:
            batch = self.batches[(task_id, "sample")]
            parts.append(f"samples {sum(r.status == 'pass' for r in samples)}/{len(samples)} pass "
                         f"({batch.seconds:.1f} s, {batch.tokens} tokens)")
        parts.append(f"elapsed {time.monotonic() - self.started:.0f} s")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def latency(self) -> dict:
        """Generation cost of each side: total and mean seconds per problem, tokens, decode speed."""
        out = {}
        for side in ("greedy", "sample"):
            batches = [b for (_, s), b in self.batches.items() if s == side]
            if not batches:
                continue
            speeds = [t.decode_tokens_per_second for b in batches for t in b.samples if t.decode_tokens_per_second]
            seconds = sum(b.seconds for b in batches)
            tokens = sum(b.tokens for b in batches)
            out[side] = {"calls": len(batches), "seconds": seconds, "seconds_per_problem": seconds / len(batches),
                         "completion_tokens": tokens, "batch_tokens_per_second": tokens / seconds if seconds else None,
                         "mean_decode_tokens_per_second": sum(speeds) / len(speeds) if speeds else None}
        return out


def _problem_set_name(spec: str) -> str:
    return spec if len(spec) <= PROBLEM_SET_CHARS else os.path.basename(spec)[-PROBLEM_SET_CHARS:]


def _load_model(args):
    from laneplay.evals.engine_generate import LocalGenerate, RemoteGenerate

    if args.engine_url:
        return RemoteGenerate(args.engine_url, model=args.model, top_p=args.top_p)
    from laneplay.engine import DEFAULT_MODEL, load_engine

    print(f"loading {args.model or DEFAULT_MODEL} on {args.device}"
          f"{' (compile on)' if args.compile else ''} ...", file=sys.stderr, flush=True)
    engine = load_engine(args.model or DEFAULT_MODEL, device=args.device, dtype=args.dtype, world_size=1,
                         compile=args.compile)
    return LocalGenerate(engine, top_p=args.top_p)


def run(args) -> int:
    from laneplay.evals.problems import ProblemError, select
    from laneplay.evals.runner import run_eval, worker_count
    from laneplay.evals.sandbox import SandboxUnavailable, require_sandbox
    from sqlalchemy.engine import make_url

    from laneplay.storage import OPERATOR, Store, ValidationError

    try:
        config = _config(args)
        problems = select(args.problems)
    except (ProblemError, ValueError) as e:
        return _fail(str(e))
    try:
        require_sandbox()  # before the model loads: no run without the sandbox, and no time wasted
    except SandboxUnavailable as e:
        return _fail(str(e))
    if args.workers and args.workers > worker_count(args.workers):
        print(f"laneplay eval: --workers {args.workers} capped at {worker_count(args.workers)} (the cores)",
              file=sys.stderr)

    store = Store(args.db)
    model = None
    try:
        try:
            model = _load_model(args)
        except (ValueError, OSError) as e:
            return _fail(f"could not load the model: {e}")
        model_name = getattr(model, "model", None) or args.model or args.engine_url
        try:
            comparison_id = store.create_comparison(  # n = 0: a greedy-only run
                problem_set=_problem_set_name(args.problems), problem_ids=[p.task_id for p in problems],
                n=config.n_samples, temperature=config.temperature, greedy=config.greedy,
                model=model_name[:200], owner=OPERATOR)
        except ValidationError as e:
            return _fail(f"cannot store this run: {e}")
        out = _out_dir(args.out)
        recorder = Recorder(problems, config, model, store, comparison_id, out / "samples.jsonl")
        print(f"comparison {comparison_id}: {len(problems)} problems, greedy {'on' if config.greedy else 'off'}, "
              f"n={config.n_samples}, {config.mode} mode, {worker_count(config.workers)} check workers; "
              f"writing {out}", file=sys.stderr, flush=True)
        try:
            result = run_eval(problems, recorder.generate, config, on_sample=recorder.on_sample)
        except KeyboardInterrupt:
            print(f"\nlaneplay eval: interrupted; {recorder.stored} of {len(problems)} problems are stored in "
                  f"comparison {comparison_id} (left unfinished) and in {out / 'samples.jsonl'}", file=sys.stderr)
            return 130
        except (RuntimeError, ValueError) as e:
            print(f"laneplay eval: {e}; {recorder.stored} of {len(problems)} problems were stored in "
                  f"comparison {comparison_id}", file=sys.stderr)
            return 1

        latency = recorder.latency()
        store.set_passk(comparison_id, result.pass_at, owner=OPERATOR, greedy_pass1=result.greedy_pass_at_1,
                        greedy_seconds=latency.get("greedy", {}).get("seconds"),
                        sampled_seconds=latency.get("sample", {}).get("seconds"))
        summary = {**result.summary(), "comparison_id": comparison_id,
                   "database": make_url(store.url).render_as_string(hide_password=True),
                   "problem_set": args.problems, "model": model_name, "device": model.device,
                   "engine_url": args.engine_url, "compile": None if args.engine_url else args.compile,
                   "top_p": args.top_p, "latency": latency}
        with open(out / "summary.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(_table(result, latency, comparison_id, model_name, out))
        return 0
    finally:
        if model is not None:
            model.close()
        store.close()


def _table(result, latency: dict, comparison_id: str, model: str | None, out: Path) -> str:
    c = result.config
    rows = [f"model {model or '?'} | {len(result.problems)} problems | {c.mode} mode | n={c.n_samples} "
            f"at temperature {c.temperature:g} | max_tokens {c.max_tokens} | seed {c.seed}", ""]
    for k in KS:
        if k in result.pass_at:
            rows.append(f"  {f'pass@{k}':<18}{result.pass_at[k]:.4f}")
    if result.greedy_pass_at_1 is not None:
        passed = result.greedy_counts["pass"]
        rows.append(f"  {'greedy pass@1':<18}{result.greedy_pass_at_1:.4f}  ({passed}/{len(result.problems)})")
    rows.append("")
    for name, counts in (("samples", result.counts if c.n_samples else None), ("greedy", result.greedy_counts)):
        if counts:
            rows.append(f"  {name + ' outcomes':<18}" + "  ".join(f"{s} {counts[s]}" for s in OUTCOMES))
    rows.append(f"  generation        {result.generation_seconds:.1f} s   execution {result.execution_seconds:.1f} s "
                f"(sandbox time, overlapping)   wall {result.wall_seconds:.1f} s")
    for side, label in (("greedy", "greedy call"), ("sample", f"{c.n_samples}-sample batch")):
        if side in latency:
            s = latency[side]
            speed = s["mean_decode_tokens_per_second"]
            batch = s["batch_tokens_per_second"]
            rows.append(f"  {label:<18}{s['seconds_per_problem']:.2f} s/problem, {s['completion_tokens']} tokens "
                        f"({f'{batch:.1f}' if batch else 'n/a'} tokens/s), "
                        f"mean decode {f'{speed:.1f}' if speed else 'n/a'} tokens/s per sample")
    if "greedy" in latency and "sample" in latency and latency["greedy"]["seconds"]:
        ratio = latency["sample"]["seconds"] / latency["greedy"]["seconds"]
        rows.append(f"  latency cost      {c.n_samples} samples take {ratio:.1f}x the greedy call's time")
    rows += ["", f"  comparison        {comparison_id}", f"  output            {out}"]
    return "\n".join(rows)
