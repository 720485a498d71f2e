"""Long prompts: time to first token and prompt tokens/s at 512, 2k and 8k tokens, ours vs transformers.

    python -m laneplay.bench.prefill [--lengths 512,2048,8190] [--rounds 2] [--dtypes float32,int4]
        [--kernels vnni,amx] [--no-hf]

Same weights (the embedded default model; ours in float32 and on the CPU's default int4 path, whose
long prompt chunks run as float GEMMs on the unpacked weights) and identical prompt ids for every
engine; each run produces exactly one token, so TTFT is the prefill. `--kernels` times the low-bit paths
on each named CPU kernel in turn (each with its own float-GEMM threshold), e.g. the VNNI kernel against
AMX tiles for prompt chunks. Ours prefills in chunks (`--chunk`, the
engine's default, `PREFILL_CHUNK`) and never holds more than chunk x length attention scores; transformers runs
its SDPA attention over the whole prompt at once. Runs alternate between the engines so drift hits all;
the ratio is the result. Peak RSS growth during each run is reported as well.
Writes bench/results/prefill-cpu.json.
"""
from __future__ import annotations

import argparse
import resource
import threading
import time

import torch

from laneplay.bench.common import check_quiet, default_engine, hf_peer, median, print_table, write_json
from laneplay.engine.runtime import PREFILL_CHUNK

SNIPPET = "def f{i}(x):\n    return x * {i} + 1\n\n"


def prompt_ids(tokenizer, length: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < length:
        ids += tokenizer.encode(SNIPPET.format(i=i))
        i += 1
    return ids[:length]


class PeakRSS:
    """The most this process's resident memory grew during a `with` block (sampled every 5 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.grew_mb = (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def ours(eng, ids, kernel: str | None = None) -> dict:
    from laneplay.engine import SamplingParams
    from laneplay.kernels import lowbit

    if kernel:
        before, gemm = lowbit.kernel_name(), lowbit.gemm_min_rows(lowbit.GEMM_MIN_ROWS[kernel])
        lowbit.use_kernel(kernel)
        try:
            return ours(eng, ids)
        finally:
            lowbit.use_kernel(before)
            lowbit.gemm_min_rows(gemm)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        for ev in eng.generate(ids, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        ttft = time.perf_counter() - t0
    return {"ttft_ms": 1000 * ttft, "prompt_tps": len(ids) / ttft, "peak_mb": mem.grew_mb, "token": ev.token_ids}


def theirs(model, ids) -> dict:
    x = torch.tensor([ids])
    with PeakRSS() as mem, torch.inference_mode():
        t0 = time.perf_counter()
        out = model(x, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - t0
    return {"ttft_ms": 1000 * ttft, "prompt_tps": len(ids) / ttft, "peak_mb": mem.grew_mb, "token": [token]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,2048,8190", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="our prefill chunk (tokens)")
    p.add_argument("--dtypes", default="float32,int4", help="our engine's weight paths to time")
    p.add_argument("--kernels", default="", help="low-bit CPU kernels to time the low-bit paths on, in turn "
                   "(default: the one chosen at import)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--allow-noisy", action="store_true", help="report on a busy machine (numbers flagged noisy)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/results)")
    args = p.parse_args(argv)
    quiet = [check_quiet(args.allow_noisy, "before")]
    from laneplay.engine.runtime import LOWBIT
    from laneplay.kernels import lowbit

    kernels = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in kernels if not lowbit.available() or k not in lowbit.kernels()]
    if unknown:
        p.error(f"--kernels: this CPU cannot run {', '.join(unknown)}")
    engines = {}  # name -> (engine, kernel)
    for d in (d for d in args.dtypes.split(",") if d):
        e = default_engine(d, prefill_chunk=args.chunk)
        for k in (kernels if d in LOWBIT and kernels else [None]):
            engines[f"ours ({d}{', ' + k if k else ''})"] = (e, k)
    if not engines:
        p.error("--dtypes names no weight path")
    eng = next(iter(engines.values()))[0]
    lengths = [int(x) for x in args.lengths.split(",")]
    context = eng.cfg.max_position_embeddings
    lengths = [min(n, context - 1) for n in lengths]
    hf = None
    if not args.no_hf:
        hf = hf_peer()
    warm = prompt_ids(eng.tokenizer, 64)
    for e, k in engines.values():
        ours(e, warm, k)
    if hf is not None:
        theirs(hf, warm)
    rows, raw = [], {}
    for n in lengths:
        ids = prompt_ids(eng.tokenizer, n)
        runs = {**{name: [] for name in engines}, "transformers": []}
        for _ in range(args.rounds):
            for name, (e, k) in engines.items():
                runs[name].append(ours(e, ids, k))
            if hf is not None:
                runs["transformers"].append(theirs(hf, ids))
        raw[n] = runs
        for name, rs in runs.items():
            if rs:
                rows.append({"engine": name, "prompt": n, "ttft_ms": median([r["ttft_ms"] for r in rs]),
                             "prompt_tps": median([r["prompt_tps"] for r in rs]),
                             "peak_mb": max(r["peak_mb"] for r in rs)})
        here = [r for r in rows if r["prompt"] == n]
        if runs["transformers"]:
            theirs_row = here[-1]
            for r in here[:-1]:
                r["vs_transformers"] = theirs_row["ttft_ms"] / r["ttft_ms"]
                r["same_token"] = "yes" if runs[r["engine"]][0]["token"] == runs["transformers"][0]["token"] else "no"
        print(f"{n} tokens: " + ", ".join(f"{r['engine']} {r['ttft_ms']:.0f} ms" for r in here))
    print(f"\nSmolLM2-135M-Instruct, {torch.get_num_threads()} threads, our chunk {args.chunk} tokens; "
          f"TTFT = prefill + one token\n")
    print_table(rows, [("engine", "engine", "s"), ("prompt", "prompt tokens", "d"), ("ttft_ms", "TTFT ms", ".0f"),
                       ("prompt_tps", "prompt tok/s", ".0f"), ("peak_mb", "peak RSS growth MB", ".0f"),
                       ("vs_transformers", "speed vs transformers", ".2f"), ("same_token", "same first token", "s")])
    quiet.append(check_quiet(True, "after"))
    path = write_json("prefill-cpu", {"schema": 2, "noisy": not all(q["quiet"] for q in quiet), "quiet": quiet,
                                      "chunk": args.chunk, "kernel": lowbit.kernel_name() if lowbit.available() else None,
                                      "rows": rows, "raw": {str(k): v for k, v in raw.items()}},
                      out=args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
