"""The `laneplay` command line.

Each subcommand lives next to the code it drives, in a module exposing
`add_arguments(parser)` and `run(args) -> int`; this file only lists them, so `laneplay --help`
stays fast (nothing heavy is imported until a command runs).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("laneplay.app.cli", "web app + engine on 127.0.0.1:7860 (engine started locally unless --engine-url)"),
    "engine": ("laneplay.engine.server_cli", "engine HTTP server only (OpenAI-compatible API)"),
    "generate": ("laneplay.engine.generate_cli", "one prompt -> stdout, then a line with TTFT and tokens/s"),
    "eval": ("laneplay.evals.cli", "pass@N over a problem set, results to SQLite + JSON"),
    "bench": ("laneplay.bench.cli", "the benchmarks (printed tables + JSON in bench/results/)"),
    "perfmodel": ("laneplay.bench.perfmodel", "batch-1 decode performance model: standard TP vs DTP on a GPU node"),
    "db": ("laneplay.storage.cli", "database maintenance (`laneplay db upgrade`)"),
    "secret": ("laneplay.app.secret_cli", "the keys that sign owner cookies (`laneplay secret rotate`)"),
}


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laneplay", description="Laneplay: latency-first playground for code LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if not _available(module):
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
