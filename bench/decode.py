"""Batch-1 decode speed of the embedded default model: ours vs Hugging Face transformers, same weights.

    python -m laneplay.bench.decode [--rounds 5] [--new-tokens 128] [--no-hf]

Both engines get identical prompt ids (the chat template applied to one question), decode greedily to
exactly `--new-tokens` tokens in float32, and are timed where tokens are produced: TTFT, and decode
tokens/s = (tokens - 1) / (t_last - t_first). Runs alternate ours / theirs so drift hits both; the
ratio is the result. Bandwidth is measured in the same run; achieved GB/s = bytes read per token x
tokens/s. Also reports n = 4 and 16 batched-sample throughput. Writes bench/results/decode-cpu.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from laneplay.bench.common import load_average, measure_bandwidth, median, print_table, write_json

QUESTION = "Write a Python function that checks whether a number is prime."


def our_run(eng, ids, new_tokens, n=1, temperature=0.0):
    from laneplay.engine import SamplingParams

    finals = {}
    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=0, n=n, ignore_eos=True)
    for ev in eng.generate(ids, params):
        if ev.finish_reason:
            finals[ev.sample_index] = ev.metrics
    m = finals[0]
    return {"ttft_ms": m.ttft_ms, "decode_tps": m.decode_tokens_per_second, "tokens": m.completion_tokens}


def hf_run(model, ids, new_tokens):
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    stamps = Stamps()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, streamer=stamps)
    t = stamps.times[1:]
    return {"ttft_ms": (t[0] - t0) * 1000, "decode_tps": (len(t) - 1) / (t[-1] - t[0]), "tokens": len(t)}


def bytes_per_token(eng, prompt_len: int, new_tokens: int) -> dict:
    """Weights read per decode step (all layers, final norm, the head, one embedding row) + mean KV."""
    m = eng.model
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    weights = sum(nbytes(t) for lw in m.layers for t in vars(lw).values()) + nbytes(m.norm) + nbytes(m.head_weight)
    weights += m.embed.shape[1] * m.embed.element_size()
    cfg = eng.cfg
    kv_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * m.embed.element_size()
    mean_pos = prompt_len + new_tokens / 2
    return {"weights": weights, "kv_mean": kv_per_pos * mean_pos}


def matvec_only_tps(eng, reps: int = 5) -> float:
    """Tokens/s if a decode step were only its weight matrix-vector products (this machine's BLAS)."""
    m = eng.model
    mats = [w for lw in m.layers for w in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
    with torch.inference_mode():
        xs = [torch.randn(w.shape[0], 1, w.shape[2], dtype=w.dtype) for w in mats]
        head_x = torch.randn(1, m.head_weight.shape[-1], dtype=m.dtype)

        def step():
            for x, w in zip(xs, mats):
                torch.bmm(x, w.transpose(1, 2))
            head_x @ m.head_weight.T

        step()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return 1 / median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--half", default="bfloat16,float16",
                   help="extra dtypes to run our compiled engine in ('' for none); the peer stays float32")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from laneplay.engine import load_engine

    print(f"load average before: {load_average():.2f} (numbers are only meaningful on a quiet machine)")
    t = time.perf_counter()
    ours = load_engine("smollm2-135m-instruct", compile=True)
    compile_s = time.perf_counter() - t
    eager = load_engine("smollm2-135m-instruct", compile=False)
    halves = {dt: load_engine("smollm2-135m-instruct", dtype=dt, compile=True) for dt in args.half.split(",") if dt}
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    hf = None
    if not args.no_hf:
        import transformers

        from laneplay.engine.checkpoint import resolve_checkpoint

        path = resolve_checkpoint("smollm2-135m-instruct")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    bw = measure_bandwidth()
    contenders = {"ours (compiled)": lambda k: our_run(ours, ids, k), "ours (eager)": lambda k: our_run(eager, ids, k)}
    contenders.update({f"ours (compiled, {dt})": (lambda k, e=e: our_run(e, ids, k)) for dt, e in halves.items()})
    if hf is not None:
        contenders["transformers (eager)"] = lambda k: hf_run(hf, ids, k)
    runs = {name: [] for name in contenders}
    for fn in contenders.values():
        fn(8)  # warm-up
    for r in range(args.rounds):  # interleaved, so drift hits every engine alike
        for name, fn in contenders.items():
            runs[name].append(fn(args.new_tokens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]['decode_tps']:.1f}" for k, v in runs.items() if v))
    bw_after = measure_bandwidth()
    matvec_tps = {"float32": matvec_only_tps(ours), **{dt: matvec_only_tps(e) for dt, e in halves.items()}}
    read_gbps = (bw["read_gbps"] + bw_after["read_gbps"]) / 2
    b = bytes_per_token(ours, len(ids), args.new_tokens)
    roofline = read_gbps * 1e9 / b["weights"]
    rows = []
    for name, rs in runs.items():
        if not rs:
            continue
        tps = median([r["decode_tps"] for r in rs])
        scale = 0.5 if "float16" in name else 1.0  # bytes per weight relative to float32
        rows.append({"engine": name, "prompt": len(ids), "new": args.new_tokens, "ttft_ms": median([r["ttft_ms"] for r in rs]),
                     "decode_tps": tps, "min": min(r["decode_tps"] for r in rs), "max": max(r["decode_tps"] for r in rs),
                     "ms_per_token": 1000 / tps, "gbps": tps * scale * (b["weights"] + b["kv_mean"]) / 1e9,
                     "roofline_frac": tps / (roofline / scale)})
    hf_tps = next((r["decode_tps"] for r in rows if r["engine"].startswith("transformers")), None)
    for r in rows:
        r["vs_transformers"] = r["decode_tps"] / hf_tps if hf_tps else None
    batched = []
    for n in (4, 16):
        our_run(ours, ids, 4, n=n, temperature=0.8)  # warm-up at this batch size
        rs = [our_run(ours, ids, args.new_tokens, n=n, temperature=0.8) for _ in range(max(1, args.rounds // 2))]
        tps = median([r["decode_tps"] for r in rs])
        batched.append({"engine": f"ours (compiled), n={n}", "per_sample_tps": tps, "aggregate_tps": n * tps,
                        "ttft_ms": median([r["ttft_ms"] for r in rs])})
    print(f"\nSmolLM2-135M-Instruct, float32, batch 1, greedy, {torch.get_num_threads()} threads; "
          f"read bandwidth {read_gbps:.1f} GB/s (copy {bw['copy_gbps']:.1f}); weights {b['weights'] / 1e6:.1f} MB/token "
          f"-> roofline {roofline:.1f} tokens/s; compile + warm-up at load {compile_s:.1f} s")
    print("eager BLAS matrix-vector products alone (a ceiling for eager engines; compiled code calls BLAS differently): " +
          ", ".join(f"{dt} {tps:.1f} tokens/s" for dt, tps in matvec_tps.items()) + "\n")
    print_table(rows, [("engine", "engine", "s"), ("ttft_ms", "TTFT ms", ".0f"), ("decode_tps", "decode tok/s", ".1f"),
                       ("min", "min", ".1f"), ("max", "max", ".1f"), ("ms_per_token", "ms/token", ".1f"),
                       ("gbps", "GB/s", ".1f"), ("roofline_frac", "of roofline", ".0%"),
                       ("vs_transformers", "vs transformers", ".2f")])
    print()
    print_table(batched, [("engine", "batched samples", "s"), ("per_sample_tps", "tok/s per sample", ".1f"),
                          ("aggregate_tps", "aggregate tok/s", ".1f"), ("ttft_ms", "TTFT ms", ".0f")])
    path = write_json("decode-cpu", {"bandwidth": {"before": bw, "after": bw_after}, "bytes_per_token": b,
                                     "roofline_tps": roofline, "matvec_only_tps": matvec_tps, "compile_s": compile_s, "rows": rows,
                                     "batched": batched, "raw": runs, "load_average_after": load_average()})
    print(f"\nload average after: {load_average():.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
