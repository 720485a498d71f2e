"""`laneplay bench`: run the benchmarks (each prints a table and writes JSON to bench/results/).

`--quick` is a smoke run that finishes in about a minute on two cores: eager float32 and the int4 default (also
served), the peers, one round, 4-token generations, a 160-token long prompt (two prefill chunks), a
4-token DTP run; its JSON has the full run's shape, and its numbers show the machinery works, not the
speed (run the full benchmark on a quiet machine for that).
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "decode": "laneplay.bench.decode",  # batch-1 decode vs transformers and llama.cpp, bandwidth, batched samples
    "dtp": "laneplay.bench.dtp",  # delayed collectives vs wait-now
    "prefill": "laneplay.bench.prefill",  # long prompts: TTFT and prompt tokens/s vs transformers
    "batching": "laneplay.bench.batching",  # many users on one engine: shared step cost, concurrent TTFT
    "serving": "laneplay.bench.serving",  # open-loop arrivals at several loads, ours vs llama-server
    "spec": "laneplay.bench.spec",  # prompt-lookup speculation on code edits and plain completions
}
# `laneplay bench load` is the serving bench under the name the many-users issue gives it (a burst of
# requests against a running server is `python -m laneplay.bench.load --url`)
BENCHMARKS["load"] = BENCHMARKS["serving"]
ALL = ("decode", "dtp", "prefill")  # what `laneplay bench` runs without a name
# Smoke sizes: every engine, peer and table of the full run, on a few tokens. The long prompts (160
# tokens) are still longer than one prefill chunk (PREFILL_CHUNK, 128), so they are prefilled in pieces.
QUICK = {"decode": ["--rounds", "1", "--new-tokens", "4", "--ours", "eager", "--half", "", "--lowbit", "int4",
                    "--samples", "2,4", "--prompts", "short,160", "--bandwidth-gib", "0.25", "--split-reps", "2"],
         "dtp": ["--rounds", "1", "--tokens", "4", "--width", "128"],
         "prefill": ["--rounds", "1", "--lengths", "160", "--dtypes", "int4"],
         "batching": ["--rows", "1,4", "--users", "1,4", "--tokens", "16", "--join-tokens", "300",
                      "--passn-problems", "1", "--dtp-users", "1,2", "--dtp-tokens", "8"],
         "serving": ["--loads", "2", "--requests", "4"],
         "spec": ["--edits", "4", "--plain", "1", "--tokens", "32", "--plain-tokens", "16", "--cost-rounds", "1",
                  "--repeat", "1"]}
QUICK["load"] = QUICK["serving"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", nargs="?", default="all", choices=["all", *BENCHMARKS],
                   help="which benchmark (default: all); `python -m laneplay.bench.<name> --help` lists its options")
    p.add_argument("--quick", action="store_true", help="a smoke run: one round, a few tokens, short prompts, eager engines")
    p.add_argument("--peers", default=None, help="decode: peers beside ours (default transformers,llama.cpp; a peer "
                   "that is not installed is skipped with a message)")
    p.add_argument("--allow-noisy", action="store_true",
                   help="report even when other processes use the cores (the numbers are flagged noisy)")
    p.add_argument("--out", default=None, help="folder for the JSON files (default: bench/results)")


def run(args) -> int:
    names = list(ALL) if args.which == "all" else [args.which]
    status = 0
    if args.quick:  # a smoke run: a shorter look at the other processes before and after each benchmark
        from laneplay.bench import common

        common.QUIET_WINDOW_S = 0.3
    for name in names:
        argv = list(QUICK[name]) if args.quick else []
        if args.allow_noisy:
            argv.append("--allow-noisy")
        if args.out:
            argv += ["--out", args.out]
        if args.peers is not None and name == "decode":
            argv += ["--peers", args.peers]
        print(f"== {name} ==", flush=True)
        try:
            status |= importlib.import_module(BENCHMARKS[name]).main(argv) or 0
        except SystemExit as e:  # a benchmark that refused (busy machine) or failed its arguments
            status |= e.code if isinstance(e.code, int) else 1
            if e.code == 3:
                return status  # the machine is busy for the next ones too
    return status
