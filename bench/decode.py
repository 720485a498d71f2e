"""Batch-1 decode speed of the embedded default model: ours vs Hugging Face transformers, same weights.

    python -m laneplay.bench.decode [--rounds 5] [--new-tokens 128] [--prompts short,512]
                                    [--peers transformers,llama.cpp] [--served int4] [--samples 2,4,8,16]

Every engine gets identical prompt ids (the chat template applied to one question, bare or after
reference code to make it 512 tokens), decodes greedily to exactly `--new-tokens` tokens, and is timed
where tokens are produced: TTFT, and decode tokens/s = (tokens - 1) / (t_last - t_first). Peers: Hugging
Face transformers on the same weights dequantized to float32, and llama.cpp (llama-cpp-python) on the
same GGUF file, Q4_1 as shipped (skipped with a message when not installed). Ours: float32 (compiled,
eager), bfloat16/float16, and the low-bit paths int4 (the CPU default: the GGUF's own Q4_1 blocks with a
Q8_0 head) and int8, and int4 once more through `laneplay engine` over HTTP (`--served`: the server
decodes on its scheduler thread, as the playground gets it); each in-process engine's split of a step (weight products / attention / other) is printed too. Runs alternate engines so
drift hits all alike; ratios are the result. Bandwidth is measured in the same run; achieved GB/s =
bytes read per token (each engine's own: float32, half or the GGUF's) x tokens/s, and the share of the
read roofline. Also batch 1 vs n samples in one batch (the cost of pass@N per sample). Ours decodes
with speculation off, one token per step as the peers do (`laneplay bench spec` measures what prompt
lookup adds: with --new-tokens and EOS ignored the small model repeats itself, which speculation
would turn into a number about the text, not the engine). Refuses to
report on a busy machine unless --allow-noisy. Writes bench/results/decode-cpu.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from laneplay.bench.common import check_quiet, default_engine, hf_peer, measure_bandwidth, median, print_table, write_json

QUESTION = "Write a Python function that checks whether a number is prime."


def our_run(eng, ids, new_tokens, n=1, temperature=0.0):
    from laneplay.engine import SamplingParams

    finals = {}
    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=0, n=n, ignore_eos=True)
    for ev in eng.generate(ids, params, speculative="off"):  # one token per step, as the peers decode
        if ev.finish_reason:
            finals[ev.sample_index] = ev.metrics
    m = finals[0]
    return {"ttft_ms": m.ttft_ms, "decode_tps": m.decode_tokens_per_second, "tokens": m.completion_tokens}


def served_engine(dtype: str, wait: bool = True):
    """`laneplay engine` started as the playground starts it (`LocalEngine`): the model loaded on the
    server's main thread, requests decoded on its scheduler thread, behind HTTP. Returns it ready, or
    (wait=False) starting: `served_ready` waits for it, so it can load while this process loads its peers."""
    from laneplay.app.supervisor import LocalEngine

    eng = LocalEngine("smollm2-135m-instruct", dtype=dtype)
    eng.start()
    return served_ready(eng, dtype) if wait else eng


def served_ready(eng, dtype: str):
    if not eng.wait_ready(300):
        eng.stop()
        raise RuntimeError(f"`laneplay engine --dtype {dtype}` did not come up: {eng.detail}")
    return eng


def served_run(url, ids, new_tokens):
    """One request to a served engine; its own timing (the same metrics as our_run's)."""
    from laneplay.api_client import SyncEngineClient

    with SyncEngineClient(url, timeout_s=600, connect_s=600) as client:
        out = client.complete({"prompt": ids, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
                               "laneplay": {"speculative": "off"}}, chat=False)
    t = out["laneplay"]
    return {"ttft_ms": t["ttft_ms"], "decode_tps": t["decode_tokens_per_second"],
            "tokens": out["usage"]["completion_tokens"]}


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
    """Weights read per decode step (all layers, final norm, the head, one embedding row), as this engine
    holds them (float, half, or packed low-bit blocks with their scales), and the mean count of KV values
    read (each engine's cache has its own element size)."""
    m = eng.model
    weights = sum(t.nbytes for lw in m.layers for t in vars(lw).values()) + m.norm.nbytes + m.head_weight.nbytes
    weights += m.embed.shape[1] * m.embed.element_size()
    cfg = eng.cfg
    values_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    mean_pos = prompt_len + new_tokens / 2
    float32 = sum(t.numel() for lw in m.layers for t in vars(lw).values()) + m.norm.numel() + m.head_weight.numel()
    float32 = 4 * (float32 + m.embed.shape[1])
    return {"weights": weights, "float32_weights": float32, "kv_values_mean": values_per_pos * mean_pos}


def matvec_only_tps(eng, reps: int = 5) -> float:
    """Tokens/s if a decode step were only its weight matrix-vector products (this machine's BLAS)."""
    from laneplay.bench.split import time_ms, weight_products

    with torch.inference_mode():
        return 1000 / time_ms(weight_products(eng.model), reps)


def long_prompt_ids(tokenizer, length: int) -> list[int]:
    """A chat prompt of exactly `length` tokens: reference code (this package's own source, a fixed text)
    followed by QUESTION, the code cut by binary search on its length in characters."""
    import inspect

    from laneplay.evals import prompting

    code = inspect.getsource(prompting) * 4

    def ids_for(chars: int) -> list[int]:
        content = "Here is some reference code:\n```python\n" + code[:chars] + "\n```\n\n" + QUESTION
        return tokenizer.encode_chat([{"role": "user", "content": content}])

    lo, hi = 0, len(code)
    while lo < hi:  # the largest cut whose prompt is at most `length` tokens
        mid = (lo + hi + 1) // 2
        if len(ids_for(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    ids = ids_for(lo)
    if len(ids) != length:  # a token boundary skipped `length`: pad the user text by single spaces
        for pad in range(1, 64):
            ids = tokenizer.encode_chat([{"role": "user", "content": "Here is some reference code:\n```python\n"
                                          + code[:lo] + " " * pad + "\n```\n\n" + QUESTION}])
            if len(ids) == length:
                break
    return ids


def llamacpp_model():
    """llama.cpp (llama-cpp-python) on the same GGUF file, or (None, why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, ("llama.cpp peer skipped: llama-cpp-python is not installed (build it from its source package "
                      "as README's \"How we measure speed\" describes)")
    from laneplay.engine.checkpoint import resolve_checkpoint

    from laneplay.bench.peers import check_llama_cpp

    path = resolve_checkpoint("smollm2-135m-instruct")
    threads = torch.get_num_threads()
    why = check_llama_cpp(str(path), threads)  # before loading it here: a wrong build ends the process
    if why:
        return None, f"llama.cpp peer skipped: {why}"
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, seed=0, verbose=False)
    return llm, f"llama.cpp {getattr(llama_cpp, '__version__', '?')}, {path.name}, flash-attn on, {threads} threads"


def llamacpp_run(llm, ids, new_tokens):
    """Greedy, exactly `new_tokens` tokens (EOS does not stop it), timed where tokens come out."""
    llm.reset()
    times = []
    t0 = time.perf_counter()
    for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if len(times) >= new_tokens:
            break
    return {"ttft_ms": (times[0] - t0) * 1000, "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
            "tokens": len(times)}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", default="short,512", help="prompt lengths: 'short' (the bare question) and/or "
                   "a number of tokens (reference code + the question)")
    p.add_argument("--peers", default="transformers,llama.cpp",
                   help="peers to run beside ours: transformers, llama.cpp ('' for none); a peer that is not "
                        "installed is skipped with a message")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer (same as leaving it out of --peers)")
    p.add_argument("--ours", default="compiled,eager", help="our float32 engine: compiled and/or eager")
    p.add_argument("--half", default="bfloat16,float16",
                   help="extra dtypes to run our compiled engine in ('' for none); the peers stay as they are")
    p.add_argument("--lowbit", default="int4,int8",
                   help="our low-bit CPU paths to run ('' for none): int4 (the CPU default), int8")
    p.add_argument("--served", default="int4", help="low-bit dtypes also timed through `laneplay engine` over "
                   "HTTP, the path the playground uses ('' for none)")
    p.add_argument("--samples", default="2,4,8,16", help="batched samples n to time against batch 1 ('' for none)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth probe (DRAM: >= 0.25)")
    p.add_argument("--split-reps", type=int, default=20, help="timed calls per part of a step's split")
    p.add_argument("--allow-noisy", action="store_true", help="report on a busy machine (numbers flagged noisy)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/results)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peers = [x for x in _csv(args.peers) if not (args.no_hf and x == "transformers")]
    unknown = (set(peers) - {"transformers", "llama.cpp"} | set(_csv(args.ours)) - {"compiled", "eager"}
               | (set(_csv(args.lowbit)) | set(_csv(args.served))) - {"int4", "int8"})
    if unknown or args.rounds < 1 or args.new_tokens < 2 or args.split_reps < 1:
        p.error(f"unknown peer or engine {sorted(unknown)}" if unknown
                else "--rounds >= 1, --new-tokens >= 2 and --split-reps >= 1")
    quiet = [check_quiet(args.allow_noisy, "before")]
    t = time.perf_counter()
    ours = {}
    for kind in _csv(args.ours):
        ours[f"ours ({kind})"] = default_engine(compile=kind == "compiled")
    compile_s = time.perf_counter() - t
    for dt in _csv(args.half):
        ours[f"ours (compiled, {dt})"] = default_engine(dt, compile=True)
    notes = []
    from laneplay.kernels import lowbit

    for dt in _csv(args.lowbit):
        if lowbit.available():
            ours[f"ours ({dt})"] = default_engine(dt)
        else:
            notes.append(f"ours ({dt}) skipped: the low-bit CPU kernels are not built (`make venv` builds them)")
            print(notes[-1])
    first = next(iter(ours.values()))
    prompts = {}
    for name in _csv(args.prompts):
        prompts[name] = (first.tokenizer.encode_chat([{"role": "user", "content": QUESTION}]) if name == "short"
                         else long_prompt_ids(first.tokenizer, int(name)))
    contenders = {name: (lambda ids, k, e=e: our_run(e, ids, k)) for name, e in ours.items()}
    # the served engines load in their own processes while this one loads the peers (nothing is timed yet)
    served = [(dt, served_engine(dt, wait=False)) for dt in (_csv(args.served) if lowbit.available() else [])]
    servers = [eng for _, eng in served]
    try:
        hf = hf_peer() if "transformers" in peers else None
        for dt, eng in served:
            served_ready(eng, dt)
            contenders[f"ours ({dt}, served)"] = lambda ids, k, url=eng.url: served_run(url, ids, k)
    except BaseException:
        for eng in servers:
            eng.stop()
        raise
    if hf is not None:
        contenders["transformers (eager)"] = lambda ids, k: hf_run(hf, ids, k)
    llm = None
    if "llama.cpp" in peers:
        llm, why = llamacpp_model()
        notes.append(why)
        print(why)
        if llm is not None:
            contenders["llama.cpp (Q4_1)"] = lambda ids, k: llamacpp_run(llm, ids, k)
    bw = measure_bandwidth(args.bandwidth_gib)
    runs = {(name, pname): [] for pname in prompts for name in contenders}
    for pname, ids in prompts.items():
        for fn in contenders.values():
            fn(ids, min(8, args.new_tokens))  # warm-up at this prompt length (compiled code may specialise)
    for r in range(args.rounds):  # interleaved, so drift hits every engine alike
        for pname, ids in prompts.items():
            for name, fn in contenders.items():
                runs[(name, pname)].append(fn(ids, args.new_tokens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k[0]} @{k[1]} {v[-1]['decode_tps']:.1f}"
                                                           for k, v in runs.items() if v))
    for server in servers:
        server.stop()
    bw_after = measure_bandwidth(args.bandwidth_gib)
    quiet.append(check_quiet(True, "after"))
    from laneplay.engine.runtime import CPU_DEFAULT

    base = ours.get(f"ours ({CPU_DEFAULT})") or ours.get("ours (compiled)") or first  # the default CPU path
    matvec_tps = {f"{name}": matvec_only_tps(e) for name, e in ours.items() if "eager" not in name}
    read_gbps = (bw["read_gbps"] + bw_after["read_gbps"]) / 2
    gguf_bytes = None
    if llm is not None:
        from laneplay.engine.checkpoint import resolve_checkpoint

        gguf_bytes = resolve_checkpoint("smollm2-135m-instruct").stat().st_size
    rows = []
    for (name, pname), rs in runs.items():
        own = ours.get(name.replace(", served", ""))
        b = bytes_per_token(own or first, len(prompts[pname]), args.new_tokens)
        # peers: llama.cpp reads the GGUF as shipped, transformers the weights dequantized to float32
        weights = b["weights"] if own is not None else gguf_bytes if name.startswith("llama.cpp") else b["float32_weights"]
        # ours as its model keeps it; llama.cpp's cache is float16, transformers' float32
        kv_size = own.model.kv_dtype.itemsize if own is not None else 2 if name.startswith("llama.cpp") else 4
        kv = b["kv_values_mean"] * kv_size
        tps = median([r["decode_tps"] for r in rs])
        rows.append({"engine": name, "prompt": pname, "prompt_tokens": len(prompts[pname]), "new": args.new_tokens,
                     "ttft_ms": median([r["ttft_ms"] for r in rs]), "decode_tps": tps,
                     "min": min(r["decode_tps"] for r in rs), "max": max(r["decode_tps"] for r in rs),
                     "ms_per_token": 1000 / tps, "bytes_per_token": weights + kv,
                     "gbps": tps * (weights + kv) / 1e9, "roofline_frac": tps * weights / (read_gbps * 1e9)})
    for r in rows:
        ref = next((x["decode_tps"] for x in rows if x["engine"].startswith("transformers")
                    and x["prompt"] == r["prompt"]), None)
        lc = next((x["decode_tps"] for x in rows if x["engine"].startswith("llama.cpp") and x["prompt"] == r["prompt"]),
                  None)
        r["vs_transformers"] = r["decode_tps"] / ref if ref else None
        r["vs_llama_cpp"] = r["decode_tps"] / lc if lc else None
    batched = []
    short = prompts.get("short") or next(iter(prompts.values()))
    ns = [int(n) for n in _csv(args.samples)]
    if ns:
        one = [our_run(base, short, args.new_tokens) for _ in range(max(1, args.rounds // 2))]
        batched.append({"engine": "n=1", "n": 1, "per_sample_tps": median([r["decode_tps"] for r in one]),
                        "ttft_ms": median([r["ttft_ms"] for r in one])})
    for n in ns:
        our_run(base, short, min(4, args.new_tokens), n=n, temperature=0.8)  # warm-up at this batch size
        rs = [our_run(base, short, args.new_tokens, n=n, temperature=0.8) for _ in range(max(1, args.rounds // 2))]
        batched.append({"engine": f"n={n}", "n": n, "per_sample_tps": median([r["decode_tps"] for r in rs]),
                        "ttft_ms": median([r["ttft_ms"] for r in rs])})
    for b_ in batched:
        b_["aggregate_tps"] = b_["n"] * b_["per_sample_tps"]
        b_["step_cost_vs_n1"] = batched[0]["per_sample_tps"] / b_["per_sample_tps"]
    from laneplay.bench.split import decode_split

    split = [{"engine": name, "prompt": pname, **decode_split(e, ids, reps=args.split_reps)}
             for pname, ids in prompts.items() for name, e in ours.items()]
    noisy = not all(q["quiet"] for q in quiet)
    print(f"\nSmolLM2-135M-Instruct, batch 1, greedy, {torch.get_num_threads()} threads, {args.new_tokens} new tokens; "
          f"read bandwidth {read_gbps:.1f} GB/s (copy {bw['copy_gbps']:.1f}), measured in this run; "
          f"our float32 load incl. compile {compile_s:.1f} s" + ("  ** NOISY MACHINE **" if noisy else ""))
    print("eager BLAS matrix-vector products alone (a ceiling for eager engines): " +
          ", ".join(f"{k} {v:.1f} tokens/s" for k, v in matvec_tps.items()) + "\n")
    print_table(rows, [("engine", "engine", "s"), ("prompt_tokens", "prompt", "d"), ("ttft_ms", "TTFT ms", ".0f"),
                       ("decode_tps", "decode tok/s", ".1f"), ("min", "min", ".1f"), ("max", "max", ".1f"),
                       ("ms_per_token", "ms/token", ".1f"), ("gbps", "GB/s", ".1f"),
                       ("roofline_frac", "of roofline", ".0%"), ("vs_transformers", "vs transformers", ".2f"),
                       ("vs_llama_cpp", "vs llama.cpp", ".2f")])
    print("\nwhere a decode step goes (ms/token; `laneplay.bench.split`):")
    print_table(split, [("engine", "engine", "s"), ("context", "context", "d"), ("step_ms", "step", ".2f"),
                        ("matrices_ms", "weight products", ".2f"), ("attention_ms", "attention", ".2f"),
                        ("other_ms", "other", ".2f")])
    if batched:
        print()
        print_table(batched, [("engine", "samples in one batch", "s"), ("per_sample_tps", "tok/s per sample", ".1f"),
                              ("aggregate_tps", "aggregate tok/s", ".1f"), ("step_cost_vs_n1", "step vs n=1", ".2f"),
                              ("ttft_ms", "TTFT ms", ".0f")])
    path = write_json("decode-cpu", {"schema": 2, "noisy": noisy, "quiet": quiet, "notes": notes,
                                     "bandwidth": {"before": bw, "after": bw_after, "read_gbps": read_gbps},
                                     "matvec_only_tps": matvec_tps, "compile_s": compile_s, "rows": rows,
                                     "batched": batched, "split": split,
                                     "raw": [{"engine": k[0], "prompt": k[1], "runs": v} for k, v in runs.items()]},
                      out=args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
