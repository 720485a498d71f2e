"""DTP: delayed collectives vs "wait now" at the same world size, same run, same engine.

    python -m laneplay.bench.dtp [--world-size N] [--tokens 64] [--rounds 3]

A random Laneformer checkpoint shaped like the released model (8 lanes, 15 layers, GQA, 10 sliding-window
layers, broadcast_delay 2) at a small width is written to a temp dir and served by N ranks. For each
mode the table gives ms/token and, from rank 0's timeline, the time per token spent blocked in
collectives: waits on delayed all-reduces (what overlap did not hide), immediate waits ("wait now"),
and the blocking ones (early layers, final aggregation). On CPU (gloo, ranks sharing 2 cores) these
numbers check that overlap happens and the function is unchanged, not speed; on GPUs (NCCL) they are
the real A/B. Writes bench/results/dtp-<device>.json.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from laneplay.bench.common import check_quiet, median, print_table, write_json


def released_shape(width: int) -> dict:
    from laneplay.engine.checkpoint import tiny_laneformer_config

    return tiny_laneformer_config(
        vocab_size=8192, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=15,
        num_attention_heads=32, num_key_value_heads=16, num_lanes=8, broadcast_delay=2, use_early_comm=True,
        sliding_window=256, sliding_window_n_layers=10, max_position_embeddings=1024)


def run_mode(eng, tokens: int, rounds: int) -> dict:
    from laneplay.engine import SamplingParams

    prompt = list(range(10, 42))
    tps, per_token = [], {"wait": [], "exposed": [], "blocking": [], "step": []}
    for _ in range(rounds):
        final = None
        for ev in eng.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
            final = ev.metrics if ev.finish_reason else final
        tps.append(final.decode_tokens_per_second)
        tl = getattr(eng.runner, "last_timeline", None) or {}
        for k in per_token:
            per_token[k].append(tl.get(k, {}).get("ms", 0.0) / tokens)
    t = median(tps)
    return {"decode_tps": t, "ms_per_token": 1000 / t, **{f"{k}_ms": median(v) for k, v in per_token.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=None, help="default: 2 on CPU, all GPUs on CUDA")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--allow-noisy", action="store_true", help="report on a busy machine (numbers flagged noisy)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/results)")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1:
        p.error("--tokens >= 2 and --rounds >= 1")
    quiet = [check_quiet(args.allow_noisy, "before")]
    from laneplay.engine import load_engine
    from laneplay.engine.checkpoint import random_laneformer_tensors, write_checkpoint

    ws = args.world_size or (max(1, torch.cuda.device_count()) if args.device == "cuda" else 2)
    raw = released_shape(args.width)
    rows = []
    with tempfile.TemporaryDirectory(prefix="laneplay-bench-") as d:
        write_checkpoint(d, raw, random_laneformer_tensors(raw, seed=0))
        single = load_engine(d, device=args.device, compile=False)
        run_mode(single, min(8, args.tokens), 1)
        rows.append({"mode": "single process (all lanes local)", "world": 1, **run_mode(single, args.tokens, args.rounds)})
        single.close()
        if ws > 1:
            eng = load_engine(d, device=args.device, world_size=ws, timeline=True)
            try:
                for wait_now in (False, True, False):  # delayed twice: before and after, to see drift
                    eng.runner.configure(wait_now=wait_now, timeline=True)
                    run_mode(eng, min(8, args.tokens), 1)
                    name = "wait now (exposed)" if wait_now else "delayed (DTP)"
                    rows.append({"mode": name, "world": ws, **run_mode(eng, args.tokens, args.rounds)})
            finally:
                eng.close()
    device = args.device
    note = ("CPU: gloo ranks share the cores, so these rows check overlap and correctness, not speed."
            if device == "cpu" else "GPU: NCCL collectives; the delayed/wait-now ratio is the DTP gain.")
    print(f"\nLaneformer-shaped random model (D={args.width}, 15 layers, 8 lanes, d=2), {device}, "
          f"{args.tokens} tokens x {args.rounds} rounds. {note}\n")
    print_table(rows, [("mode", "mode", "s"), ("world", "ranks", "d"), ("ms_per_token", "ms/token", ".2f"),
                       ("decode_tps", "tok/s", ".1f"), ("wait_ms", "delayed-wait ms/tok", ".2f"),
                       ("exposed_ms", "wait-now ms/tok", ".2f"), ("blocking_ms", "blocking ms/tok", ".2f"),
                       ("step_ms", "rank-0 step ms", ".2f")])
    delayed = [r for r in rows if r["mode"].startswith("delayed")]
    exposed = [r for r in rows if r["mode"].startswith("wait now")]
    if delayed and exposed:
        ratio = median([r["ms_per_token"] for r in exposed]) / median([r["ms_per_token"] for r in delayed])
        print(f"\nwait-now / delayed ms per token: {ratio:.2f}x")
    quiet.append(check_quiet(True, "after"))
    path = write_json(f"dtp-{device}", {"schema": 2, "noisy": not all(q["quiet"] for q in quiet), "quiet": quiet,
                                        "config": raw, "world_size": ws, "rows": rows, "note": note}, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
