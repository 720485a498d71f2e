"""`laneplay bench`: run the benchmarks (each prints a table and writes JSON to bench/results/)."""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "decode": "laneplay.bench.decode",  # batch-1 decode vs transformers, bandwidth, batched samples
    "dtp": "laneplay.bench.dtp",  # delayed collectives vs wait-now
    "prefill": "laneplay.bench.prefill",  # long prompts: TTFT and prompt tokens/s vs transformers
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", nargs="?", default="all", choices=["all", *BENCHMARKS],
                   help="which benchmark (default: all); `python -m laneplay.bench.<name> --help` lists its options")
    p.add_argument("--quick", action="store_true", help="fewer rounds and tokens (a smoke run)")


def run(args) -> int:
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    quick = {"decode": ["--rounds", "2", "--new-tokens", "32"], "dtp": ["--rounds", "1", "--tokens", "16"],
             "prefill": ["--rounds", "1", "--lengths", "512,2048"]}
    status = 0
    for name in names:
        print(f"== {name} ==")
        status |= importlib.import_module(BENCHMARKS[name]).main(quick[name] if args.quick else [])
    return status
