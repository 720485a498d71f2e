"""Is the low-bit CPU path as good as float32? Measured, not assumed, on the embedded default model.

    python -m laneplay.bench.lowbit_quality [--dtypes int4,int8] [--humaneval] [--problems humaneval]

1. Teacher-forced agreement over a fixed code corpus (every HumanEval prompt followed by its canonical
   solution: 164 pieces of Python), run as generation runs (the prompt prefilled, the solution decoded
   token by token): at each solution position, does the low-bit engine pick the same next token as the
   float32 engine (top-1 agreement rate), and how far apart are the logits (max and mean |Δlogit|)?
2. With --humaneval: greedy HumanEval pass@1 of float32 and of each low-bit path (instruct mode, the
   same prompts, generation stopped at 512 tokens), each completion checked in the sandbox. The float32
   run is the long one (~25 min on two cores); `--humaneval-dtypes int4,int8` reruns only those and keeps
   the other dtypes' rows of the previous JSON (each row says when it was measured).
Writes bench/results/lowbit-quality.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from laneplay.bench.common import print_table, write_json


@torch.inference_mode()
def teacher_forced(engines: dict, problems, tokenizer) -> list[dict]:
    """As generation runs: each low-bit engine prefills the HumanEval prompt and then decodes the canonical
    solution one token at a time (teacher-forced); float32's logits at the same positions are the
    reference. Counted over the solution's tokens (the positions that generation decodes)."""
    ref = engines["float32"]
    stats = {name: {"agree": 0, "positions": 0, "max": 0.0, "sum": 0.0} for name in engines if name != "float32"}
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        ids = torch.tensor([tokenizer.encode(p.prompt + (p.canonical_solution or ""))])
        n, full = ids.shape[1], ids[0].tolist()
        split = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), n))
        split = max(1, min(split, n - 1))  # where the tokens of prompt and solution part (a merged token decodes)
        want = ref.logits(ids)[0, split - 1:n - 1]
        for name, st in stats.items():
            m = engines[name].model
            first, cache = m.prefill(ids[:, :split], 1, n + 1)
            got = torch.cat([first[:1]] + [m.decode(ids[:, q:q + 1], q, cache) for q in range(split, n - 1)])
            diff = (got - want).abs()
            st["agree"] += int((got.argmax(-1) == want.argmax(-1)).sum())
            st["positions"] += got.shape[0]
            st["max"] = max(st["max"], float(diff.max()))
            st["sum"] += float(diff.mean(-1).sum())
    return [{"dtype": name, "positions": st["positions"], "top1_agreement": st["agree"] / st["positions"],
             "max_abs_dlogit": st["max"], "mean_abs_dlogit": st["sum"] / st["positions"]}
            for name, st in stats.items()]


def humaneval_pass1(engine, problems, max_tokens: int) -> dict:
    from laneplay.evals.engine_generate import LocalGenerate
    from laneplay.evals.runner import EvalConfig, run_eval

    t = time.perf_counter()
    gen = LocalGenerate(engine)
    result = run_eval(problems, gen, EvalConfig(mode="instruct", n_samples=0, greedy=True, max_tokens=max_tokens))
    return {"greedy_pass1": result.greedy_pass_at_1, "problems": len(problems), "seconds": time.perf_counter() - t}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="int4,int8", help="low-bit paths to check against float32")
    p.add_argument("--humaneval", action="store_true", help="also greedy HumanEval pass@1 for every dtype (long)")
    p.add_argument("--problems", default="humaneval", help="the problem set (see `laneplay eval --problems`)")
    p.add_argument("--humaneval-dtypes", default=None,
                   help="with --humaneval: which dtypes to run now (default: float32 and --dtypes); the others' "
                        "rows are kept from the previous JSON")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/results)")
    args = p.parse_args(argv)
    from laneplay.bench.common import RESULTS
    from laneplay.engine import load_engine
    from laneplay.evals.problems import select
    from laneplay.kernels import lowbit

    dtypes = ["float32"] + [d.strip() for d in args.dtypes.split(",") if d.strip()]
    engines = {d: load_engine("smollm2-135m-instruct", dtype=d, compile=False) for d in dtypes}
    corpus = select("humaneval")
    agreement = teacher_forced(engines, corpus, engines["float32"].tokenizer)
    print(f"teacher-forced over {len(corpus)} HumanEval prompts + canonical solutions, vs float32:\n")
    print_table(agreement, [("dtype", "dtype", "s"), ("positions", "positions", "d"),
                            ("top1_agreement", "top-1 agreement", ".2%"), ("max_abs_dlogit", "max |Δlogit|", ".3f"),
                            ("mean_abs_dlogit", "mean |Δlogit|", ".4f")])
    passes = []
    if args.humaneval:
        problems = select(args.problems)
        now = dtypes if args.humaneval_dtypes is None else [d.strip() for d in args.humaneval_dtypes.split(",")]
        if set(now) - set(dtypes):
            p.error(f"--humaneval-dtypes {sorted(set(now) - set(dtypes))} not among float32 and --dtypes")
        previous = Path(args.out or RESULTS) / "lowbit-quality.json"
        kept = {}
        if set(dtypes) - set(now) and previous.is_file():
            old = json.loads(previous.read_text())
            if old.get("problems") == args.problems:
                kept = {r["dtype"]: {"when": old.get("when"), **r} for r in old.get("humaneval") or []}
        for d in dtypes:
            if d not in now:
                if d in kept:
                    passes.append(kept[d])
                    print(f"{d}: greedy pass@1 {kept[d]['greedy_pass1']:.3f} (kept from {kept[d]['when']})")
                continue
            if d == "float32":  # the reference decodes compiled, as `laneplay serve` would run it
                engines[d].close()
                engines[d] = load_engine("smollm2-135m-instruct", dtype=d, compile=True)
            passes.append({"dtype": d, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           **humaneval_pass1(engines[d], problems, args.max_tokens)})
            print(f"{d}: greedy pass@1 {passes[-1]['greedy_pass1']:.3f} ({passes[-1]['seconds']:.0f} s)", flush=True)
        print()
        print_table(passes, [("dtype", "dtype", "s"), ("problems", "problems", "d"),
                             ("greedy_pass1", "greedy pass@1", ".3f"), ("seconds", "seconds", ".0f")])
    corpus_name = "HumanEval prompts prefilled, canonical solutions decoded, all problems"
    path = write_json("lowbit-quality", {"schema": 1, "corpus": corpus_name,
                                         "activation_bits": lowbit.activation_bits() if lowbit.available() else None,
                                         "agreement": agreement, "humaneval": passes,
                                         "problems": args.problems if passes else None}, out=args.out)
    print(f"\nwrote {path}")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
