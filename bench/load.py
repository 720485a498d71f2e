"""Burst test for a running engine server: N concurrent streaming clients; TTFT, queue wait and tokens/s percentiles.

    python -m laneplay.bench.load --url http://127.0.0.1:8000 --clients 20 --max-tokens 32

All clients send one streaming request at the same moment. The engine steps the requests it admits
together (iteration-level batching, up to its `--max-rows`) and queues the rest, so client TTFT (send ->
first text) grows with the queue beyond that; the server's own numbers -- queue wait, engine TTFT, decode
tokens/s -- come from the "laneplay" field of each final chunk. Prints a table and writes JSON to
bench/results/load-<time>.json. Open-loop arrivals at several loads, ours against llama.cpp's llama-server
on the same GGUF, is `laneplay bench load` (bench/serving.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

import httpx

from laneplay.api_client import EngineClient, EngineError, StreamTimer

RESULTS = Path(__file__).parent / "results"


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (no interpolation: with 20 clients, p99 is the slowest one)."""
    values = sorted(v for v in values if v is not None)
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)] if values else None


async def one_client(client: EngineClient, i: int, args) -> dict:
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed + i,
            "ignore_eos": not args.stop_at_eos}
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    out = {"client": i, "status": None, "error": None, "ttft_ms": None, "e2e_ms": None, "tokens": 0, "server": None}
    timer = StreamTimer()
    try:
        async for ev in client.stream(body, args.chat):
            out["status"] = 200  # the stream began
            if ev.kind == "delta":
                timer.on_delta(ev.index, ev.text, None)
            elif ev.kind == "done" and ev.usage:
                out["tokens"], out["server"] = ev.usage.get("completion_tokens", 0), ev.timing
    except EngineError as e:
        out["status"], out["error"] = e.status or out["status"], e.message
    out["ttft_ms"] = min((c.ttft_ms for c in timer.choices.values() if c.ttft_ms is not None), default=None)
    out["e2e_ms"] = timer.elapsed_ms()
    return out


async def run_load(args) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 2, max_keepalive_connections=args.clients + 2)
    async with EngineClient(args.url, api_key=args.api_key, timeout_s=args.timeout, connect_s=args.timeout,
                            limits=limits) as client:
        health = await client.health()
        t0 = time.perf_counter()
        clients = await asyncio.gather(*(one_client(client, i, args) for i in range(args.clients)))
        wall = time.perf_counter() - t0
    ok = [c for c in clients if c["status"] == 200 and not c["error"]]
    server = [c["server"] or {} for c in ok]

    def pcts(values):
        return {"p50": percentile(values, 50), "p99": percentile(values, 99)}

    tokens = sum(c["tokens"] for c in ok)
    return {
        "url": args.url, "model": health.get("model"), "device": health.get("device"),
        "world_size": health.get("world_size"), "clients": args.clients, "max_tokens": args.max_tokens,
        "chat": args.chat, "ok": len(ok), "errors": len(clients) - len(ok),
        "status_counts": {str(s): sum(c["status"] == s for c in clients) for s in {c["status"] for c in clients}},
        "wall_s": wall, "tokens": tokens, "throughput_tokens_per_second": tokens / wall if wall > 0 else None,
        "client_ttft_ms": pcts([c["ttft_ms"] for c in ok]),
        "queue_ms": pcts([s.get("queue_ms") for s in server]),
        "engine_ttft_ms": pcts([s.get("ttft_ms") for s in server]),
        "decode_tokens_per_second": pcts([s.get("decode_tokens_per_second") for s in server]),
        "e2e_ms": pcts([c["e2e_ms"] for c in ok]),
        "per_client": clients,
    }


def print_table(r: dict) -> None:
    def fmt(x):
        return "n/a" if x is None else f"{x:.1f}"

    print(f"{r['clients']} clients x {r['max_tokens']} tokens on {r['model']} ({r['device']} x{r['world_size']}): "
          f"{r['ok']} ok, {r['errors']} failed {r['status_counts']}, {r['wall_s']:.1f} s")
    print(f"{'':28}{'p50':>10}{'p99':>10}")
    for key, label in [("client_ttft_ms", "client TTFT (ms)"), ("queue_ms", "queue wait (ms)"),
                       ("engine_ttft_ms", "engine TTFT (ms)"), ("decode_tokens_per_second", "decode tokens/s"),
                       ("e2e_ms", "end to end (ms)")]:
        print(f"{label:28}{fmt(r[key]['p50']):>10}{fmt(r[key]['p99']):>10}")
    print(f"throughput: {fmt(r['throughput_tokens_per_second'])} tokens/s over {r['tokens']} tokens")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laneplay.bench.load", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="def quicksort(items):")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (the prompt is the user message)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0, help="client i uses seed + i")
    p.add_argument("--stop-at-eos", action="store_true", help="let samples end early (default: exactly max-tokens)")
    p.add_argument("--api-key", default=os.environ.get("LANEPLAY_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON result")
    args = p.parse_args(argv)
    try:
        result = asyncio.run(run_load(args))
    except EngineError as e:
        print(f"laneplay.bench.load: cannot reach the engine at {args.url} ({e}); start it with `laneplay engine`",
              file=sys.stderr)
        return 2
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"load-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
