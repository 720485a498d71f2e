"""Many people, one engine: what a shared decode step costs, and what concurrent users see.

    python -m laneplay.bench.batching [--rows 1,2,4,8,16] [--users 1,4,8] [--tokens 128]

Two tables, on the embedded default (the CPU default path unless --dtype says otherwise):
1. one decode step for k separate requests (k groups of one row, each on its own cache at its own
   position: what the scheduler runs) against a step for one; the ratio is what sharing costs a row;
2. k streaming clients sent at once to an engine server in this process, 128 greedy tokens each, with
   the engine one request at a time (--max-rows 1, the old scheduler's behaviour) and batching
   (--max-rows 16), in the same run: client TTFT (send -> first text) min / median / max and the wall
   time until all are done, each against the same engine's single-client run.
3. three requests decoding while a 1,500-token prompt joins: their time between tokens against their
   ms/token alone and one prefill chunk;
4. a Playground request beside a pass@N-like run (8 problems, greedy then N=8, batch priority): its
   TTFT and tokens/s against the same request on an idle engine;
5. a ~1,000-token prompt, then the same code with a new instruction: TTFT cold and with the prefix
   reused (whole prefill chunks, --prefill-chunk).
JSON to bench/results/batching.json.
6. the same k clients on a DTP engine (--dtp-world ranks of the embedded default, gloo on the CPU: the
   ranks share the cores, so this shows batching on the ranks, not DTP's speed), one at a time against
   batched by the ranks; JSON to bench/results/batching-dtp.json (--dtp-only runs just this table).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time

import torch

from laneplay.api_client import ChoiceTiming, EngineClient, StreamTimer
from laneplay.bench.common import check_quiet, print_table, write_json
from laneplay.processes import in_own_thread

PROMPTS = ["def quicksort(items):\n", "# Parse a CSV line into fields.\ndef parse(line):\n",
           "class LRUCache:\n    def __init__(self, capacity):\n", "def is_prime(n: int) -> bool:\n",
           "import json\n\ndef load(path):\n", "def fizzbuzz(n):\n", "def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
           "async def fetch_all(urls):\n"]


def step_costs(engine, rows: list[int], context: int = 200, repeats: int = 20) -> list[dict]:
    model = engine.model
    out, base = [], None
    for k in rows:
        caches = [model.prefill(torch.full((1, context + i), 7, dtype=torch.long), 1, context + 64)[1] for i in range(k)]
        groups = [(context + i, c) for i, c in enumerate(caches)]  # every request at its own position
        tokens = torch.full((k, 1), 7, dtype=torch.long)
        for _ in range(3):
            model.decode_groups(tokens, groups)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.decode_groups(tokens, groups)
            times.append((time.perf_counter() - t0) * 1000)
        ms = statistics.median(times)
        base = base or ms
        out.append({"requests": k, "ms_per_step": ms, "vs_one": ms / base, "ms_per_row": ms / k})
    return out


def engine_client(url: str, **kwargs) -> EngineClient:
    """The benches' client of an engine server: one connection pool, no short connect timeout."""
    return EngineClient(url, timeout_s=600, connect_s=600, **kwargs)


async def timed_request(client: EngineClient, body: dict) -> dict:
    """One streamed completion (greedy, ignore_eos unless `body` says otherwise): the client's TTFT (send
    -> first text), the gaps between its tokens, its decode tokens/s, and the server's final `laneplay`
    record (empty from other servers) and usage."""
    timer, server, usage = StreamTimer(), {}, {}
    async for ev in client.stream({"temperature": 0, "ignore_eos": True, **body}, chat=False):
        if ev.kind == "delta":
            timer.on_delta(0, ev.text, None)  # every choice's text on one clock, as one stream
        elif ev.kind == "done":
            server, usage = ev.timing or {}, ev.usage or {}
    c = timer.choices.get(0) or ChoiceTiming()
    return {"ttft_ms": c.ttft_ms, "gaps_ms": c.latencies_ms, "tokens": c.tokens, "tps": c.decode_tps,
            "e2e_s": timer.elapsed_ms() / 1000, "server": server, "usage": usage}


def long_prompt_joins(engine, prompt_tokens: int = 1500) -> dict:
    """Three requests decode; a long prompt arrives: their time between tokens while it is prefilled,
    against their ms/token alone and one prefill chunk's time (the longest of that prompt's chunks).
    Speculation is off in these requests: a verify hands over several tokens at once, which is not the
    gap this measures."""
    from laneplay.bench.load import percentile

    long_ids = engine.tokenizer.encode(_code(200))[:prompt_tokens]

    def longest_chunk() -> float:  # the longest of the prompt's own chunks (later chunks attend to more keys)
        steps, t0, longest = engine.model.prefill_steps(torch.tensor([long_ids]), 1, len(long_ids) + 16,
                                                        chunk=engine.runtime.prefill_chunk), time.perf_counter(), 0.0
        for _ in steps:
            now = time.perf_counter()
            longest, t0 = max(longest, (now - t0) * 1000), now
        return longest

    # in a thread that ends, as `laneplay engine` loads its model: an OpenMP pool left in this thread
    # would make the served engine's thread the second pool, whose waits then sleep (processes.in_own_thread)
    chunk_ms = min(in_own_thread(longest_chunk) for _ in range(2))

    async def go(url):
        async with engine_client(url) as http:
            plain = {"laneplay": {"speculative": "off"}}
            alone = await timed_request(http, {"prompt": PROMPTS[0], "max_tokens": 96, **plain})
            runners = [asyncio.create_task(timed_request(http, {"prompt": PROMPTS[i], "max_tokens": 256, **plain}))
                       for i in range(3)]
            await asyncio.sleep(1.0)
            t_join = time.perf_counter()
            joiner = await timed_request(http, {"prompt": long_ids, "max_tokens": 8, **plain})
            t_joined = time.perf_counter()
            three = await asyncio.gather(*runners)
            return alone, three, joiner, t_join, t_joined

    with InProcessServer(engine, 16) as url:
        alone, three, joiner, t_join, t_joined = asyncio.run(go(url))
    gaps = [g for r in three for g in r["gaps_ms"]]
    alone_ms = statistics.median(alone["gaps_ms"])
    p99 = percentile(gaps, 99)
    return {"prompt_tokens": len(long_ids), "alone_ms_per_token": alone_ms, "chunk_ms": chunk_ms,
            "tbt_p50_ms": percentile(gaps, 50), "tbt_p99_ms": p99, "tbt_max_ms": max(gaps),
            "bound_ms": 2 * alone_ms + chunk_ms, "joiner_ttft_ms": joiner["ttft_ms"],
            "holds": p99 <= 2 * alone_ms + chunk_ms}


def beside_passn(engine, problems: int = 8, n: int = 8, requests: int = 5) -> dict:
    """A pass@N-like run (per problem: greedy, then n samples; batch priority) while Playground requests
    stream 128 tokens each, one after another (`requests` of them, a quarter second apart, so they land
    on different moments of the run): their median TTFT and tokens/s against the same request on an idle
    engine (median of three)."""
    from laneplay.evals.problems import select

    prompts = [p.prompt for p in select(f"humaneval:0-{problems}")]

    async def go(url):
        async with engine_client(url) as http:
            body = {"prompt": PROMPTS[3], "max_tokens": 128}
            idle = [await timed_request(http, body) for _ in range(3)]

            async def passn():
                for p in prompts:
                    for k, temp in ((1, 0.0), (n, 0.8)):
                        await http.complete({"prompt": p, "max_tokens": 128, "n": k, "temperature": temp,
                                             "seed": 0, "laneplay": {"priority": "batch"}}, chat=False)

            job = asyncio.create_task(passn())
            await asyncio.sleep(1.0)
            busy = []
            for _ in range(requests):
                busy.append(await timed_request(http, body))
                await asyncio.sleep(0.25)
            still = not job.done()
            job.cancel()
            return idle, busy, still

    with InProcessServer(engine, 16) as url:
        idle, busy, still = asyncio.run(go(url))
    med = statistics.median
    out = {"problems": problems, "n": n, "requests": len(busy), "passn_running": still,
           "idle_ttft_ms": med(r["ttft_ms"] for r in idle), "busy_ttft_ms": med(r["ttft_ms"] for r in busy),
           "busy_ttft_max_ms": max(r["ttft_ms"] for r in busy),
           "idle_tps": med(r["tps"] for r in idle), "busy_tps": med(r["tps"] for r in busy)}
    out["ttft_vs_idle"] = out["busy_ttft_ms"] / out["idle_ttft_ms"]
    out["tps_vs_idle"] = out["busy_tps"] / out["idle_tps"]
    return out


class InProcessServer:
    def __init__(self, engine, max_rows: int, prefix_cache: bool = True):
        import uvicorn

        from laneplay.processes import free_port
        from laneplay.engine.server import create_app

        self.port = free_port()
        app = create_app(engine, max_rows=max_rows, max_queue=64)
        if not prefix_cache:
            app.state.scheduler.prefixes = None
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


async def _users(url: str, k: int, tokens: int, speculative: str | None = None) -> dict:
    """k clients at once (prompt i of PROMPTS each), and first each of those k requests alone, one after
    another: with speculation ("auto") a prompt's alone time depends on how much its text repeats, so the
    wall of k is also compared with the slowest of the same k requests alone, and each request's time until
    done with its own time alone (`worst_vs_own_alone`: the largest of those ratios). speculative: the
    requests' "laneplay" speculation (None: the engine's default)."""
    extra = {"laneplay": {"speculative": speculative}} if speculative else {}

    def body(i: int) -> dict:
        return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, **extra}

    async with engine_client(url) as http:
        await timed_request(http, {**body(0), "max_tokens": 4})  # warm the connection and the engine
        alone = [(await timed_request(http, body(i)))["e2e_s"] for i in range(k)] if k > 1 else []
        t0 = time.perf_counter()
        clients = await asyncio.gather(*(timed_request(http, body(i)) for i in range(k)))
        wall = time.perf_counter() - t0
    ttfts = [c["ttft_ms"] for c in clients]
    slowest = max(alone) if alone else wall
    done = statistics.mean(c["e2e_s"] for c in clients)  # each request's own wait until it is done
    return {"users": k, "ttft_min_ms": min(ttfts), "ttft_median_ms": statistics.median(ttfts),
            "ttft_max_ms": max(ttfts), "wall_s": wall, "mean_done_s": done,
            "mean_done_vs_alone": done / statistics.mean(alone) if alone else 1.0,
            "worst_vs_own_alone": max(c["e2e_s"] / a for c, a in zip(clients, alone)) if alone else 1.0,
            "slowest_alone_s": slowest, "wall_vs_slowest_alone": wall / slowest,
            "rows_per_step": max(c["server"].get("rows_per_step") or 0 for c in clients)}


async def _copies(url: str, prompt: int, k: int, tokens: int) -> dict:
    """One prompt alone, then k copies of it at once (the same request from k clients): the plainest
    reading of "k requests at once against one alone", where every request is the one measured alone."""
    async with engine_client(url) as http:
        await timed_request(http, {"prompt": PROMPTS[prompt], "max_tokens": 4})  # warm
        alone = await timed_request(http, {"prompt": PROMPTS[prompt], "max_tokens": tokens})
        t0 = time.perf_counter()
        clients = await asyncio.gather(*(timed_request(http, {"prompt": PROMPTS[prompt], "max_tokens": tokens})
                                         for _ in range(k)))
        wall = time.perf_counter() - t0
    u = alone["usage"]
    ttft = max(c["ttft_ms"] for c in clients)
    return {"prompt": prompt, "users": k, "alone_ttft_ms": alone["ttft_ms"], "alone_s": alone["e2e_s"],
            "acceptance": u["accepted_tokens"] / u["draft_tokens"] if u.get("draft_tokens") else None,
            "ttft_max_ms": ttft, "wall_s": wall, "wall_vs_alone": wall / alone["e2e_s"],
            "ttft_max_vs_alone": ttft / alone["ttft_ms"]}


def copies(engine, prompts: int, k: int, tokens: int) -> list[dict]:
    """`_copies` for each of the first `prompts` PROMPTS, on the batched engine."""
    with InProcessServer(engine, 16) as url:
        return [asyncio.run(_copies(url, i, k, tokens)) for i in range(prompts)]


def concurrency(engine, users: list[int], tokens: int, modes: dict[str, tuple[int, str | None]]) -> list[dict]:
    """`_users` for each k of `users` on a server per mode: {name: (rows per step, speculation)}."""
    out = []
    for mode, (max_rows, speculative) in modes.items():
        with InProcessServer(engine, max_rows) as url:
            alone = None
            for k in users:
                row = {"engine": mode, **asyncio.run(_users(url, k, tokens, speculative))}
                alone = alone or row
                row["ttft_max_vs_alone"] = row["ttft_max_ms"] / alone["ttft_max_ms"]
                row["wall_vs_alone"] = row["wall_s"] / alone["wall_s"]
                out.append(row)
    return out


def _code(lines: int) -> str:
    """A long, plausible module: numbered helper functions (no two prompts of a run share it by chance)."""
    return "".join(f"def helper_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n"
                   f"        total += v * scale - {i % 7}\n    return total\n\n\n" for i in range(lines))


def prefix_reuse(engine, target_tokens: int = 1000, tokens: int = 16) -> dict:
    """A ~1,000-token prompt, then the same code with a new instruction: client TTFT cold and warm."""
    code, n = "", 8
    while len(engine.tokenizer.encode(code + "# Add type hints to helper_3.\n")) < target_tokens:
        n += 1
        code = _code(n)
    prompts = [code + "# Add type hints to helper_3.\n", code + "# Write a docstring for helper_5.\n"]

    async def go(url):
        async with engine_client(url) as http:
            return [await timed_request(http, {"prompt": p, "max_tokens": tokens}) for p in prompts]

    with InProcessServer(engine, 16) as url:
        cold, warm = asyncio.run(go(url))
    u = warm["usage"]
    return {"prompt_tokens": u.get("prompt_tokens"), "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cold_ttft_ms": cold["ttft_ms"], "warm_ttft_ms": warm["ttft_ms"],
            "warm_vs_cold": warm["ttft_ms"] / cold["ttft_ms"],
            "prefill_chunk": engine.runtime.prefill_chunk}


USER_COLUMNS = [("engine", "engine", "s"), ("users", "users", "d"), ("ttft_min_ms", "TTFT min ms", ".0f"),
                ("ttft_median_ms", "median", ".0f"), ("ttft_max_ms", "max", ".0f"),
                ("ttft_max_vs_alone", "max x alone", ".2f"), ("wall_s", "wall s", ".2f"),
                ("wall_vs_alone", "wall x alone", ".2f"), ("wall_vs_slowest_alone", "x its slowest alone", ".2f"),
                ("mean_done_s", "mean done s", ".2f"), ("mean_done_vs_alone", "mean x alone", ".2f"),
                ("worst_vs_own_alone", "worst x own alone", ".2f"),
                ("rows_per_step", "rows/step", ".1f")]

COPIES_COLUMNS = [("prompt", "prompt", "d"), ("acceptance", "drafts kept alone", ".2f"), ("alone_ttft_ms", "TTFT alone ms", ".0f"),
                  ("ttft_max_ms", "max of 4 ms", ".0f"), ("alone_s", "alone s", ".2f"), ("wall_s", "4 at once s", ".2f"),
                  ("wall_vs_alone", "x alone", ".2f")]


def dtp_users(args, quiet) -> None:
    """Table 6: k clients at once on a DTP engine, one at a time and batched by the ranks."""
    from laneplay.engine import load_engine

    engine = load_engine("smollm2-135m-instruct", dtype=args.dtype, world_size=args.dtp_world)
    try:
        rows = concurrency(engine, [int(x) for x in args.dtp_users.split(",")], args.dtp_tokens,
                           {"one at a time": (1, None), "batched by the ranks": (16, None)})
    finally:
        engine.close()
    print(f"\nk clients at once on {args.dtp_world} DTP ranks (gloo, sharing the cores), {args.dtp_tokens} greedy "
          "tokens each")
    print_table(rows, USER_COLUMNS)
    path = write_json("batching-dtp", {"dtype": engine.runtime.dtype, "world_size": args.dtp_world,
                                       "tokens": args.dtp_tokens, "quiet": quiet, "users": rows}, args.out)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="laneplay bench batching", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rows", default="1,2,4,8,16", help="requests per decode step (table 1)")
    p.add_argument("--users", default="1,4,8", help="concurrent clients (table 2; the first is the alone run)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill step (the engine's default)")
    p.add_argument("--join-tokens", type=int, default=1500, help="the long prompt that joins three decodes")
    p.add_argument("--passn-problems", type=int, default=8, help="problems of the pass@N-like run (N = 8)")
    p.add_argument("--dtp-world", type=int, default=3, help="ranks of the DTP table (3 divides the default's "
                   "9 heads; 0 skips it)")
    p.add_argument("--dtp-users", default="1,4", help="concurrent clients on the DTP engine")
    p.add_argument("--dtp-tokens", type=int, default=64)
    p.add_argument("--dtp-only", action="store_true", help="run the DTP table alone")
    p.add_argument("--allow-noisy", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    quiet = check_quiet(args.allow_noisy)
    from laneplay.engine import load_engine

    if args.dtp_world:
        dtp_users(args, quiet)
    if args.dtp_only:
        return 0
    chunk = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}
    # this thread runs no torch work itself: the served engine's thread is then the one OpenMP pool, as in
    # `laneplay engine` (processes.in_own_thread)
    engine = in_own_thread(load_engine, "smollm2-135m-instruct", dtype=args.dtype, **chunk)
    rows = in_own_thread(step_costs, engine, [int(x) for x in args.rows.split(",")])
    print(f"one decode step for k separate requests ({engine.runtime.dtype}, {torch.get_num_threads()} threads)")
    print_table(rows, [("requests", "requests", "d"), ("ms_per_step", "ms/step", ".1f"), ("vs_one", "x one", ".2f"),
                       ("ms_per_row", "ms/row", ".2f")])
    users = concurrency(engine, [int(x) for x in args.users.split(",")], args.tokens,
                        {"one at a time": (1, None), "batched": (16, None),
                         "batched, speculation off": (16, "off")})
    print(f"\nk clients at once, {args.tokens} greedy tokens each: client TTFT (send -> first text) and wall time")
    print_table(users, USER_COLUMNS)
    same = copies(engine, 4, 4, args.tokens)
    print(f"\nthe same request from 4 clients at once ({args.tokens} greedy tokens each) against it alone")
    print_table(same, COPIES_COLUMNS)
    joins = long_prompt_joins(engine, args.join_tokens)
    print("\nthree requests decode while a long prompt joins: their time between tokens (TBT)")
    print_table([joins], [("prompt_tokens", "prompt", "d"), ("alone_ms_per_token", "alone ms/token", ".1f"),
                          ("chunk_ms", "one chunk ms", ".0f"), ("tbt_p50_ms", "TBT p50", ".1f"),
                          ("tbt_p99_ms", "TBT p99", ".1f"), ("bound_ms", "2x alone + chunk", ".0f"),
                          ("joiner_ttft_ms", "its TTFT ms", ".0f")])
    beside = beside_passn(engine, args.passn_problems)
    print(f"\n{beside['requests']} Playground requests (128 tokens each, one after another) while a pass@N run "
          f"({args.passn_problems} problems, N=8, batch priority) works: medians")
    print_table([beside], [("idle_ttft_ms", "TTFT idle ms", ".0f"), ("busy_ttft_ms", "beside pass@N", ".0f"),
                           ("busy_ttft_max_ms", "max", ".0f"),
                           ("ttft_vs_idle", "x idle", ".2f"), ("idle_tps", "tok/s idle", ".1f"),
                           ("busy_tps", "beside pass@N", ".1f"), ("tps_vs_idle", "x idle", ".2f")])
    prefix = prefix_reuse(engine)
    print("\nthe same ~1,000-token code with a new instruction: client TTFT cold, then with its prefix reused")
    print_table([prefix], [("prompt_tokens", "prompt tokens", "d"), ("cached_tokens", "reused", "d"),
                           ("cold_ttft_ms", "cold TTFT ms", ".0f"), ("warm_ttft_ms", "reused TTFT ms", ".0f"),
                           ("warm_vs_cold", "reused / cold", ".2f")])
    path = write_json("batching", {"dtype": engine.runtime.dtype, "tokens": args.tokens, "quiet": quiet,
                                   "step_costs": rows, "users": users, "copies": same, "long_prompt_joins": joins,
                                   "beside_passn": beside, "prefix_reuse": prefix}, args.out)
    print(f"wrote {path}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
