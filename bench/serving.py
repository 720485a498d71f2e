"""Serving many users: open-loop arrivals of code requests, ours against llama.cpp's llama-server.

    python -m laneplay.bench.serving [--loads 1,2,4,8] [--requests 24] [--llama-server PATH]

Requests arrive at random (Poisson) times at a rate chosen so that, on average, `load` requests are in
flight if each took its alone time (Little's law: rate = load / mean alone duration, the alone duration
measured on our engine first). Each request is a code prompt of 50-2,000 tokens (HumanEval prompts put
together) and asks for 64-512 greedy tokens; the schedule (arrival times, prompts, lengths) is drawn
from a fixed seed, one per load (no load finds the previous one's prompts cached), and sent unchanged
to each server, one server after the other:
- ours: `laneplay engine` (the embedded default, the CPU default path, iteration-level batching);
- llama-server from the llama.cpp sources in the pinned llama-cpp-python sdist (`--llama-server`, or
  $LLAMA_SERVER), same GGUF, `--parallel 8` slots with continuous batching, the same threads.
Per load: TTFT from send (p50 / p99), time between tokens (p50 / p99 over every gap of every
request), per-user decode tokens/s (median) and aggregate tokens/s. JSON to bench/results/serving.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

import httpx

from laneplay.api_client import EngineClient
from laneplay.bench.batching import timed_request
from laneplay.bench.common import check_quiet, print_table, write_json
from laneplay.bench.load import percentile


def build_schedule(tokenizer, n: int, seed: int) -> list[dict]:
    """n requests: prompt text of 50-2,000 tokens (log-uniform), 64-512 new tokens; arrival order."""
    from laneplay.evals.problems import select

    corpus = tokenizer.encode("\n\n".join(p.prompt for p in select("humaneval")))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(round(50 * (40 ** rng.random())))  # 50 .. 2,000
        start = rng.randrange(0, len(corpus) - length)
        out.append({"prompt": tokenizer.decode(corpus[start:start + length]), "prompt_tokens": length,
                    "max_tokens": rng.choice([64, 128, 256, 512])})
    return out


async def run_schedule(url: str, schedule: list[dict], rate: float, seed: int, extra: dict) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in schedule:
        arrivals.append(t)
        t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(schedule) + 2)
    async with EngineClient(url, timeout_s=1200, connect_s=1200, limits=limits) as http:
        t0 = time.perf_counter()

        async def at(when, req):
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            return await timed_request(http, {"prompt": req["prompt"], "max_tokens": req["max_tokens"], **extra})

        results = await asyncio.gather(*(at(a, r) for a, r in zip(arrivals, schedule)))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps_ms"]]
    tokens = sum(r["tokens"] for r in results)
    return {"ttft_p50_ms": percentile([r["ttft_ms"] for r in results], 50),
            "ttft_p99_ms": percentile([r["ttft_ms"] for r in results], 99),
            "tbt_p50_ms": percentile(gaps, 50), "tbt_p99_ms": percentile(gaps, 99),
            "user_tps_median": statistics.median([r["tps"] for r in results if r["tps"]]),
            "aggregate_tps": tokens / wall, "wall_s": wall}


class LlamaServer:
    def __init__(self, binary: str, gguf: str, threads: int, parallel: int, context: int):
        from laneplay.processes import free_port

        self.port = free_port()
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                    "-tb", str(threads), "--parallel", str(parallel), "-c", str(context), "--cont-batching"]

    def __enter__(self):
        """Starts the server and has it decode a few tokens (every kernel of the timed run runs once)."""
        from laneplay.bench.peers import crash_reason

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    r = httpx.post(url + "/completion", json={"prompt": "def add(a, b):", "n_predict": 4}, timeout=60)
                    if r.status_code == 200:
                        return url
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        code = self.proc.poll()
        if code is None:
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError("llama-server did not answer a 4-token request within 120 s")
        raise RuntimeError(f"llama-server does not run here: {crash_reason(code)}")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="laneplay bench serving", description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="1,2,4,8", help="average requests in flight")
    p.add_argument("--requests", type=int, default=24, help="requests per load")
    p.add_argument("--seed", type=int, default=0)
    beside = os.path.join(os.path.dirname(sys.executable), "llama-server")  # where `make bench-peers` puts it
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
                   or (beside if os.path.exists(beside) else None))
    p.add_argument("--allow-noisy", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    quiet = check_quiet(args.allow_noisy)
    import torch

    from laneplay.bench.batching import InProcessServer
    from laneplay.engine import load_engine
    from laneplay.engine.checkpoint import resolve_checkpoint

    engine = load_engine("smollm2-135m-instruct", dtype="auto")
    threads = torch.get_num_threads()
    loads = [float(x) for x in args.loads.split(",")]
    # Each load gets its own prompts (the same for both servers): a prompt seen at one load must not find
    # its prefix cached at the next.
    schedules = [build_schedule(engine.tokenizer, args.requests, args.seed + 1 + i) for i in range(len(loads))]
    rows = []
    with InProcessServer(engine, 16, prefix_cache=False) as url:  # the mean alone duration, on ours
        alone = [asyncio.run(run_schedule(url, [r], 1.0, 0, {}))["wall_s"]
                 for r in build_schedule(engine.tokenizer, 6, args.seed)]
    mean_alone = statistics.mean(alone)
    servers = [("ours", lambda: InProcessServer(engine, 16), {})]
    if args.llama_server:
        try:  # before it is timed: a peer built for another CPU is skipped, with the reason
            with LlamaServer(args.llama_server, str(resolve_checkpoint("smollm2-135m-instruct")), threads, 1, 2048):
                pass
        except (OSError, RuntimeError) as e:
            print(f"llama-server peer skipped: {e}", file=sys.stderr)
            args.llama_server = None
    if args.llama_server:
        servers.append(("llama-server", lambda: LlamaServer(args.llama_server, str(resolve_checkpoint(
            "smollm2-135m-instruct")), threads, 8, 8 * 2600), {}))
    else:
        print("llama-server peer skipped: pass --llama-server (built from the llama.cpp sources in the pinned "
              "llama-cpp-python sdist)", file=sys.stderr)
    for name, make, extra in servers:
        with make() as url:
            for load, schedule in zip(loads, schedules):
                r = asyncio.run(run_schedule(url, schedule, load / mean_alone, args.seed, extra))
                rows.append({"server": name, "load": load, **r})
                print(f"{name} load {load}: {r}", flush=True)
    print(f"\n{args.requests} requests per load, prompts 50-2,000 tokens, 64-512 greedy tokens, "
          f"{threads} threads; mean alone duration {mean_alone:.2f} s")
    print_table(rows, [("server", "server", "s"), ("load", "load", ".0f"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                       ("ttft_p99_ms", "p99", ".0f"), ("tbt_p50_ms", "TBT p50 ms", ".1f"),
                       ("tbt_p99_ms", "p99", ".1f"), ("user_tps_median", "user tok/s", ".1f"),
                       ("aggregate_tps", "all tok/s", ".1f")])
    path = write_json("serving", {"quiet": quiet, "threads": threads, "requests": args.requests,
                                  "mean_alone_s": mean_alone, "rows": rows}, args.out)
    print(f"wrote {path}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
