"""The one script to run on a CUDA machine: kernel correctness, then batch-1 decode speed.

    python bench/gpu_check.py [--out bench/results/gpu-check.json] [--steps 256]

1. The machine's ceilings: device-to-device copy bandwidth (bytes read + written) and read bandwidth
   (a sum over a large tensor).
2. Every Triton kernel against its torch reference on the GPU at the release's shapes and at edge cases,
   in float32, float16 and bfloat16 (bf16 only runs here: the interpreter's bf16 arithmetic is wrong).
3. Batch-1 decode of (a) a Laneformer-2B-shaped model with random weights (docs/laneformer.md §10 dimensions, fp16,
   8 lanes on one GPU) and (b) the default model (its real weights when the embedded checkpoint is
   installed, else its architecture with random weights): ms/token and tokens/s for the eager torch step,
   the static step without graphs, the whole-step CUDA graph with cuBLAS GEMVs and with the GEMV choice
   measured per weight shape, and the engine's own loop (graph replay, on-device greedy pick, the token id
   read back each step); achieved bandwidth for the bytes a step reads, against the measured bandwidth.
   Parity of the graph step against `LaneModel.decode` on the same model. Then 1, 2, 4, 8 and 16
   separate requests per step (the shared static cache's bucket graphs): ms per step against one.

Every section catches its own failure, so one broken part still leaves the others' numbers. Finishes in
well under 5 minutes on an H200. Writes JSON (and prints a table last).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bootstrap_imports() -> None:
    """Make `laneplay.*` importable from a plain checkout (no install on the GPU machine)."""
    try:
        import laneplay.engine  # noqa: F401
        return
    except ImportError:
        pass
    for name in list(sys.modules):
        if name == "laneplay" or name.startswith("laneplay."):
            del sys.modules[name]
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {name: mapping[name] for name in ("laneplay", "laneplay.engine", "laneplay.kernels", "laneplay.bench")}
    for name, folder in folders.items():
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
    for name, folder in folders.items():  # run the package bodies once every parent exists
        spec = sys.modules[name].__spec__
        spec.loader.exec_module(sys.modules[name])


_bootstrap_imports()

import torch  # noqa: E402

from laneplay.engine.checkpoint import tiny_laneformer_config  # noqa: E402
from laneplay.engine.config import ModelConfig, config_from_hf  # noqa: E402
from laneplay.engine.model import LaneModel  # noqa: E402
from laneplay.kernels import reference  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def laneformer_2b_config() -> ModelConfig:
    """docs/laneformer.md §10: D 3072, F 12288, 15 layers, 32/16 heads, 8 lanes, delay 2, layers 0-9 SWA (2048)."""
    raw = tiny_laneformer_config(
        vocab_size=32000, hidden_size=3072, intermediate_size=12288, num_hidden_layers=15, num_attention_heads=32,
        num_key_value_heads=16, num_lanes=8, broadcast_delay=2, sliding_window=2048, sliding_window_n_layers=10,
        max_position_embeddings=4096, name="laneformer-2b-shaped")
    return config_from_hf(raw, name="laneformer-2b-shaped (random weights)")


def default_model_config() -> tuple[ModelConfig, object]:
    """The embedded default's config and a weight source, or its architecture from bench/results."""
    try:
        from laneplay.engine.checkpoint import DEFAULT_MODEL, open_checkpoint, resolve_checkpoint

        cfg, src = open_checkpoint(resolve_checkpoint(DEFAULT_MODEL))
        return cfg, src
    except Exception:
        d = json.loads((RESULTS / "default-model-config.json").read_text())
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        d["name"] = d["name"] + " shape (random weights)"
        return ModelConfig(**d), None


def random_weights(cfg: ModelConfig, dtype, device, seed=0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    L, D, hd, V = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    hq, hkv, fl = cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.ffn_per_lane

    def mat(*shape, fan_in):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) / fan_in ** 0.5).to(dtype)

    w = {"embed": torch.randn(V, D, generator=g, device=device).to(dtype)}
    for i in range(cfg.num_layers):
        w[f"layers.{i}.attn_norm"] = (1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype)
        w[f"layers.{i}.ffn_norm"] = (1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype)
        w[f"layers.{i}.wqkv"] = mat(L, (hq + 2 * hkv) * hd, D, fan_in=D)
        w[f"layers.{i}.wo"] = mat(L, D, hq * hd, fan_in=hq * hd * L)
        w[f"layers.{i}.w13"] = mat(L, 2 * fl, D, fan_in=D)
        w[f"layers.{i}.w2"] = mat(L, D, fl, fan_in=fl * L)
    w["norm"] = (1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype)
    w["head"] = w["embed"] if cfg.tie_word_embeddings else mat(V, D, fan_in=D)
    return w


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. ceilings --------------------------------------------------------------------------------------

def bandwidth(dev) -> dict:
    n = 2 * 2**30 // 2  # 2 GiB of fp16
    a = torch.randn(n, device=dev, dtype=torch.float16)
    b = torch.empty_like(a)
    copy = _median_ms(lambda: b.copy_(a), 20)
    read = _median_ms(lambda: a.sum(dtype=torch.float32), 20)
    nbytes = a.numel() * a.element_size()
    return {"copy_GBps": round(2 * nbytes / copy / 1e6, 1), "read_GBps": round(nbytes / read / 1e6, 1),
            "bytes": nbytes, "method": "median of 20: b.copy_(a) counting read + write; a.sum() counting read"}


def _median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


# ---- 2. kernels against references ----------------------------------------------------------------------

def kernel_checks(dev) -> list[dict]:
    from laneplay.kernels import triton_kernels as tk

    rows = []
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

    def rel(got, ref):
        got, ref = got.float(), ref.float()
        if not torch.isfinite(got).all():
            return float("inf")
        return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()

    def record(kernel, case, dtype, err, scale=1.0):
        rows.append({"kernel": kernel, "case": case, "dtype": str(dtype).replace("torch.", ""),
                     "rel_err": err, "ok": err <= tol[dtype] * scale})

    def rnd(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for family in (_norm_cases, _rope_attention_cases, _swiglu_cases, _residual_cases, _gemv_cases):
            try:
                family(dtype, dev, record, rel, rnd, tk)
            except Exception:
                rows.append({"kernel": family.__name__.strip("_").replace("_cases", ""), "case": "error",
                             "dtype": str(dtype).replace("torch.", ""), "rel_err": float("inf"), "ok": False,
                             "error": traceback.format_exc()})
                log(rows[-1]["error"])
    return rows


def _norm_cases(dtype, dev, record, rel, rnd, tk):
    for case, (R, D, lanes) in {"2B lanes": (8, 3072, None), "lane norms, B=3": (24, 3072, 8),
                                "default": (1, 576, None)}.items():
        x = rnd(R, D, dtype=dtype)
        w = (1 + 0.1 * rnd(*((lanes, D) if lanes else (D,)), dtype=torch.float32)).to(dtype)
        record("rms_norm", case, dtype, rel(tk.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)))


def _rope_attention_cases(dtype, dev, record, rel, rnd, tk):
    from laneplay.engine.model import rope_tables

    cfg = laneformer_2b_config()
    tables = {96: rope_tables(cfg, 4096, dev), 64: rope_tables(config_from_hf(tiny_laneformer_config(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_lanes=1)), 4096, dev)}
    for case, (N, hq, hkv, hd, slots, pos) in {"2B full": (8, 4, 2, 96, 4096, 3000),
                                                "2B ring wrapped": (8, 4, 2, 96, 2048, 3000),
                                                "default B=4": (4, 9, 3, 64, 512, 17)}.items():
        cos, sin = tables[hd]
        qkv = rnd(N, (hq + 2 * hkv) * hd, dtype=dtype)
        kc, vc = rnd(N, hkv, slots, hd, dtype=dtype), rnd(N, hkv, slots, hd, dtype=dtype)
        kr, vr = kc.clone(), vc.clone()
        p = torch.tensor([pos], device=dev)
        q = tk.rope_kv_write(qkv, cos, sin, p, kc, vc, hq, hkv, hd)
        qr = reference.rope_kv_write(qkv, cos, sin, p, kr, vr, hq, hkv, hd)
        record("rope_kv_write", case, dtype, max(rel(q, qr), rel(kc, kr), rel(vc, vr)))
        for window in ((None, 2048) if slots == 4096 else (slots,)):
            w_case = f"{case}, window {window}" if window else case
            ref = reference.decode_attention(q, kc, vc, p, window)
            err = max(rel(tk.decode_attention(q, kc, vc, p, window, c), ref) for c in (None,) + tk.ATTENTION_CONFIGS)
            record("decode_attention", w_case + " (all configs)", dtype, err, scale=3)
            errs = []
            for c in (None,) + tk.ATTENTION_CONFIGS:  # the fused kernel: output and the written slot
                kf, vf, kg, vg = kc.clone(), vc.clone(), kc.clone(), vc.clone()
                kf[:, :, pos % slots] = vf[:, :, pos % slots] = float("nan")  # the kernel must write it
                got = tk.rope_attention(qkv, cos, sin, p, kf, vf, hq, hkv, hd, window, c)
                want = reference.rope_attention(qkv, cos, sin, p, kg, vg, hq, hkv, hd, window)
                errs += [rel(got, want), rel(kf, kg), rel(vf, vg)]
            record("rope_attention (fused)", w_case + " (all configs)", dtype, max(errs), scale=3)


def _swiglu_cases(dtype, dev, record, rel, rnd, tk):
    for case, (R, F) in {"2B lanes": (8, 1536), "default B=2": (2, 1536)}.items():
        gu = rnd(R, 2 * F, dtype=dtype)
        record("swiglu", case, dtype, rel(tk.swiglu(gu), reference.swiglu(gu)))


def _residual_cases(dtype, dev, record, rel, rnd, tk):
    for case, kw in {"present": dict(present=True, want_sum=True), "no_reduce": dict(scale=8 ** 0.5, want_sum=True),
                     "past": dict(past=True, want_sum=True), "past, last layers": dict(past=True)}.items():
        L, B, D = 8, 1, 3072
        kw = dict(kw)
        h, x = rnd(L, B, D, dtype=dtype), rnd(L, B, D, dtype=dtype)
        if kw.pop("past", False):
            past = rnd(L, B, D, dtype=dtype)
            kw.update(past=past, total_old=past.float().sum(0).to(dtype))
        nw = (1 + 0.1 * rnd(D, dtype=torch.float32)).to(dtype)
        kw.update(norm_weight=nw, eps=1e-5)
        gh, gs, gn = tk.residual_update(h, x, **kw)
        rh, rs, rn = reference.residual_update(h, x, **kw)
        err = max(rel(gh, rh), rel(gn, rn), rel(gs, rs) if rs is not None else 0.0)
        record("residual_update", case, dtype, err)


def _gemv_cases(dtype, dev, record, rel, rnd, tk):
    for case, (L, B, O, I) in {"2B w13": (8, 1, 3072, 3072), "2B w2": (8, 1, 3072, 1536),
                               "default B=4": (1, 4, 1536, 576)}.items():
        x, w = rnd(L, B, I, dtype=dtype), rnd(L, O, I, dtype=dtype, scale=I ** -0.5)
        ref = reference.lane_gemv(x.float(), w.float())
        err = max(rel(tk.lane_gemv(x, w, c), ref) for c in tk.GEMV_CONFIGS)
        record("lane_gemv", case + " (all configs)", dtype, err, scale=2)


# ---- 3. decode speed --------------------------------------------------------------------------------------

def step_bytes(model: LaneModel, pos: int) -> int:
    """Bytes one batch-1 decode step must read: every layer matrix, the head, one embedding row, the norms
    and the visible K/V (2 tensors x lanes x KV heads x visible slots x head_dim)."""
    cfg, item = model.cfg, model.dtype.itemsize
    total = sum(t.numel() for w in model.layers for t in (w.wqkv, w.wo, w.w13, w.w2, w.attn_norm, w.ffn_norm))
    total += model.head_weight.numel() + cfg.hidden_size + model.norm.numel()
    for i in range(cfg.num_layers):
        win = cfg.window(i)
        visible = min(pos + 1, win) if win else pos + 1
        total += 2 * cfg.num_kv_heads * visible * cfg.head_dim
    return total * item


def decode_speed(name: str, cfg: ModelConfig, weights: dict, dev, bw: dict, steps: int, prompt: int) -> dict:
    from laneplay.engine.runner import LocalRunner
    from laneplay.engine.runtime import make_runtime
    from laneplay.engine.sampling import SamplingParams
    from laneplay.engine.static_step import StaticDecoder

    out = {"model": name, "config": {k: v for k, v in cfg.to_dict().items() if not isinstance(v, (list, tuple))},
           "dtype": str(next(iter(weights.values())).dtype).replace("torch.", ""), "prompt_tokens": prompt,
           "decode_steps": steps}
    model = LaneModel(cfg, weights)
    out["weight_bytes"] = sum(t.numel() * t.element_size() for t in {id(t): t for t in weights.values()}.values())
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    mid = prompt + steps // 2
    out["bytes_per_token"] = step_bytes(model, mid)
    read_bw = bw.get("read_GBps") or bw.get("copy_GBps") / 2
    variants = {}

    def note(label, ms):
        gbps = out["bytes_per_token"] / (ms / 1e3) / 1e9
        variants[label] = {"ms_per_token": round(ms, 4), "tokens_per_s": round(1e3 / ms, 1),
                           "GBps": round(gbps, 1), "share_of_read_bw": round(gbps / read_bw, 3)}
        log(f"{name}: {label}: {ms:.3f} ms/token, {1e3 / ms:.0f} tok/s, {gbps:.0f} GB/s ({gbps / read_bw:.0%})")

    toks = torch.randint(0, cfg.vocab_size, (steps + 1, 1, 1), device=dev)
    with torch.inference_mode():
        # eager torch (LaneModel.decode)
        try:
            _, cache = model.prefill(ids, 1, prompt + steps + 1)
            n_eager = min(steps, 48)
            model.decode(toks[0], prompt, cache)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s in range(n_eager):
                model.decode(toks[s], prompt + s, cache)
            torch.cuda.synchronize()
            note("eager torch (LaneModel.decode)", (time.perf_counter() - t0) * 1e3 / n_eager)
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())
        # the static step: kernels without graphs, graphs with cuBLAS, graphs with the measured GEMV choice
        dec = StaticDecoder(model, graphs=False)  # the model's whole context, as the engine serves it
        try:
            _, cache = model.prefill(ids, 1, prompt + steps + 1)
            dec.load(cache, prompt)
            dec.step(toks[0], prompt)
            torch.cuda.synchronize()
            n = min(steps, 48)
            t0 = time.perf_counter()
            for s in range(n):
                dec.step(toks[s], prompt + s)
            torch.cuda.synchronize()
            note("static step, kernels, no graph", (time.perf_counter() - t0) * 1e3 / n)
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())

        def graph_run(label):
            dec.graphs = True
            dec.reset_graphs()
            _, cache = model.prefill(ids, 1, prompt + steps + 1)
            dec.load(cache, prompt)
            dec.step(toks[0], prompt)  # captures
            torch.cuda.synchronize()
            s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s_ev.record()
            for s in range(steps):
                dec.step(toks[s], prompt + s)
            e_ev.record()
            e_ev.synchronize()
            note(label, s_ev.elapsed_time(e_ev) / steps)

        try:
            graph_run("CUDA graph, cuBLAS GEMV")
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())
        # where a step's device time goes: one eager static step under the profiler, by kernel
        try:
            out["kernel_profile"] = profile_step(dec, model, ids, toks, prompt, steps)
            top = out["kernel_profile"][:12]
            log(f"{name}: device time per step by kernel: " + "; ".join(f"{r['kernel'][:40]} x{r['calls']} {r['us_per_step']:.0f} us" for r in top))
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())
        try:
            out["gemv_tuning"] = dec.tune_gemv(batch=1)
            chosen = [r for r in out["gemv_tuning"] if r["chosen"]]
            log(f"{name}: GEMV choice: " + "; ".join(f"{r['shape']} {r['impl']} {r['config']} {r['us']} us "
                                                     f"{r['GB/s']} GB/s" for r in chosen))
            out["attention_tuning"] = dec.tune_attention(pos=prompt + steps // 2)
            best = next(r for r in out["attention_tuning"] if r["chosen"])
            log(f"{name}: attention configs (split, block, warps, RoPE fused): " + "; ".join(
                f"{r['config']} {r['fused_rope']} {r['us_per_layer']} us" for r in out["attention_tuning"]))
            graph_run(f"CUDA graph, measured GEMV + attention {tuple(best['config'])}"
                      + (" with RoPE fused" if best["fused_rope"] else ""))
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())

        # parity: the graph step against LaneModel.decode, step by step on the same tokens
        try:
            _, c_ref = model.prefill(ids, 1, prompt + 33)
            _, c_st = model.prefill(ids, 1, prompt + 33)
            dec.graphs = True
            dec.reset_graphs()
            dec.load(c_st, prompt)
            worst, agree, tok_ref = 0.0, 0, toks[0]
            for s in range(32):
                ref = model.decode(tok_ref, prompt + s, c_ref).float()
                got = dec.step(tok_ref, prompt + s).float()
                worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
                agree += int(ref.argmax(-1).item() == got.argmax(-1).item())
                tok_ref = ref.argmax(-1).view(1, 1)
            out["parity_vs_decode"] = {"steps": 32, "max_rel_dlogit": worst, "greedy_top1_agreement": agree / 32}
            log(f"{name}: graph step vs LaneModel.decode: max rel |Δlogit| {worst:.2e}, top-1 agreement {agree}/32")
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())

        # separate requests in one step (the shared cache's bucket graphs, k requests at their own positions),
        # and speculative verification (S positions of one request in one captured verify graph)
        for key, fn, what, row in (
                ("buckets", bucket_steps, "k separate requests per graph step",
                 lambda r: f"{r['requests']}: {r['ms_per_step']:.3f} ms ({r['vs_one']:.2f}x one"),
                ("verifies", verify_steps, "verify of S positions per graph",
                 lambda r: f"{r['positions']}: {r['ms_per_verify']:.3f} ms ({r['vs_step']:.2f}x a step")):
            try:
                out[key] = fn(model, ids, prompt, steps)
                log(f"{name}: {what}: " + "; ".join(f"{row(r)}, rel |dlogit| {r['max_rel_dlogit']:.1e})" for r in out[key]))
            except Exception:
                out.setdefault("errors", []).append(traceback.format_exc())

        # the engine's loop: a LocalRunner with the graph step (greedy on device, ids read back per token)
        try:
            runtime = make_runtime("cuda", out["dtype"], graphs=True, compile=False)
            runner = LocalRunner(model, runtime)  # measures its own attention / GEMV choice, captures
            out["engine_choice"] = {"attention_config": runner.static.attention_config,
                                    "fused_rope": runner.static.fused_rope,
                                    "triton_gemv": {str(k): v[1] for k, v in runner.static.gemv.items()}}
            params = SamplingParams(max_tokens=steps, temperature=0.0).validate()
            stamps = [t for _, t, _ in runner.token_steps(ids[0].tolist(), params, [0], set())]
            gaps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))  # the first gap holds the capture
            step_ms = gaps[len(gaps) // 2] * 1e3
            note("engine loop (graph + pick + id to host), median", step_ms)
            runner.close()
        except Exception:
            out.setdefault("errors", []).append(traceback.format_exc())
    out["variants"] = variants
    for e in out.get("errors", []):
        log(f"{name}: ERROR\n{e}")
    return out


def bucket_steps(model: LaneModel, ids, prompt: int, steps: int) -> list[dict]:
    """`StaticDecoder.groups` as the scheduler runs it: k requests (prompts of different lengths, so
    different positions) in one captured step per bucket; ms per step, and the first step's logits
    against `LaneModel.decode_groups` on copies of the same caches."""
    from laneplay.engine.static_step import StaticDecoder

    rows, base = [], None
    for k in (1, 2, 4, 8, 16):
        dec = StaticDecoder(model, capacity=prompt + k + steps + 8, graphs=True)
        own, ref = [], []
        for i in range(k):
            own.append(model.prefill(ids[:, :prompt + i], 1, prompt + i + steps + 4)[1])
            ref.append(model.prefill(ids[:, :prompt + i], 1, prompt + i + steps + 4)[1])
        tokens = ids[:, :k].T.contiguous()
        got = dec.groups(tokens, [(prompt + i, c) for i, c in enumerate(own)]).float()  # captures the bucket
        want = model.decode_groups(tokens, [(prompt + i, c) for i, c in enumerate(ref)]).float()
        worst = ((got - want).abs().max() / want.abs().max()).item()
        torch.cuda.synchronize()
        s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_ev.record()
        for s in range(1, steps):
            dec.groups(tokens, [(prompt + i + s, c) for i, c in enumerate(own)])
        e_ev.record()
        e_ev.synchronize()
        ms = s_ev.elapsed_time(e_ev) / (steps - 1)
        base = base or ms
        rows.append({"requests": k, "ms_per_step": ms, "vs_one": ms / base, "max_rel_dlogit": worst})
        del dec, own, ref
        torch.cuda.empty_cache()
    return rows


def verify_steps(model: LaneModel, ids, prompt: int, steps: int) -> list[dict]:
    """`StaticDecoder.verify` as a speculating request runs it: S positions (its last token and S - 1
    drafts) in one captured graph per bucket; ms per verify against one graph step, and the verify's
    logits against S `LaneModel.decode` steps on a copy of the same cache."""
    from laneplay.engine.static_step import StaticDecoder

    dec = StaticDecoder(model, capacity=prompt + steps + 40, graphs=True)
    cache = model.prefill(ids[:, :prompt], 1, prompt + 20)[1]
    dec.load(cache, prompt)
    tok = ids[:, :1]

    def timed(fn, reps=steps):
        fn()
        torch.cuda.synchronize()
        s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s_ev.record()
        for _ in range(reps):
            fn()
        e_ev.record()
        e_ev.synchronize()
        return s_ev.elapsed_time(e_ev) / reps

    step_ms = timed(lambda: dec.step(tok, prompt))  # rewrites the same position: the cache stays as loaded
    rows = []
    for S in (2, 4, 8, 16):
        toks = ids[:, :S]
        got = dec.verify(toks, prompt)[0][0].float()
        ref = model.prefill(ids[:, :prompt], 1, prompt + 20)[1]
        want = torch.cat([model.decode(toks[:, j:j + 1], prompt + j, ref).float() for j in range(S)])
        worst = ((got - want).abs().max() / want.abs().max()).item()
        ms = timed(lambda: dec.verify(toks, prompt))
        rows.append({"positions": S, "ms_per_verify": ms, "vs_step": ms / step_ms, "step_ms": step_ms,
                     "max_rel_dlogit": worst})
    return rows


def profile_step(dec, model, ids, toks, prompt, steps) -> list[dict]:
    """Kernel device time of the static step (kernels, no graph), averaged over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    dec.graphs = False
    _, cache = model.prefill(ids, 1, prompt + steps + 1)
    dec.load(cache, prompt)
    dec.step(toks[0], prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(5):
            dec.step(toks[s], prompt + s)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count > 0:
            rows.append({"kernel": e.key, "calls": e.count / 5, "us_per_step": t / 5})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    for r in rows:
        r["share"] = round(r["us_per_step"] / total, 3) if total else None
    return rows


def calibration(res: dict) -> dict:
    """The performance model's H200 parameters from this run (`laneplay perfmodel` reads them): the measured
    read bandwidth, the share of it the step's GEMVs stream (their device time in the profile over the
    weight bytes), and the rest of the graph step's time per kernel boundary."""
    bw = (res.get("bandwidth") or {}).get("read_GBps")
    m = next((m for m in res.get("models", []) if m.get("model", "").startswith("laneformer") and "variants" in m), None)
    if not bw or m is None or not m.get("kernel_profile"):
        return {}
    prof = m["kernel_profile"]
    gemv_us = sum(r["us_per_step"] for r in prof if any(t in r["kernel"].lower() for t in ("nvjet", "gemm", "gemv")))
    calls = sum(r["calls"] for r in prof)
    graph = min((v["ms_per_token"] for k, v in m["variants"].items() if k.startswith("CUDA graph")), default=None)
    weights = m["weight_bytes"] - m["config"]["vocab_size"] * m["config"]["hidden_size"] * 2  # the embedding: one row
    if not gemv_us or not graph:
        return {}
    eff = weights / (gemv_us * 1e-6) / (bw * 1e9)
    return {"device": res["gpu"], "hbm_gbps": bw, "bw_efficiency": round(eff, 3),
            "launch_us": round((graph * 1e3 - gemv_us) / calls, 2),
            "calibration_note": f"one H200, whole-model matrices ({weights / 1e9:.2f} GB of GEMV weights in "
                                f"{gemv_us:.0f} us), {calls:.0f} kernels per step; an 8-GPU rank's per-lane "
                                f"matrices are 8x smaller and stream less efficiently"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "gpu-check.json"))
    ap.add_argument("--steps", type=int, default=256, help="decode steps timed per variant")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before the timed steps")
    ap.add_argument("--kernels-only", action="store_true", help="check the kernels, skip the decode timings")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; the CPU tests cover the kernels under TRITON_INTERPRET=1")
        return 2
    dev = torch.device("cuda")
    import triton

    props = torch.cuda.get_device_properties(dev)
    res = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": props.name, "sms": props.multi_processor_count,
           "memory_GiB": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(res, indent=1, default=str))

    t_all = time.perf_counter()
    try:
        res["bandwidth"] = bandwidth(dev)
        log(f"bandwidth: {res['bandwidth']}")
    except Exception:
        res["bandwidth"] = {"error": traceback.format_exc()}
    save()
    try:
        t0 = time.perf_counter()
        res["kernels"] = kernel_checks(dev)
        bad = [r for r in res["kernels"] if not r["ok"]]
        log(f"kernel checks: {len(res['kernels']) - len(bad)}/{len(res['kernels'])} within tolerance "
            f"({time.perf_counter() - t0:.0f} s)")
        for r in bad:
            log(f"  OUT OF TOLERANCE: {r}")
    except Exception:
        res["kernels_error"] = traceback.format_exc()
        log(res["kernels_error"])
    save()
    if args.kernels_only:
        res["seconds"] = round(time.perf_counter() - t_all, 1)
        save()
        print_table(res)
        return 0 if res.get("kernels") and all(r["ok"] for r in res["kernels"]) else 1
    bw = res.get("bandwidth", {})
    if "error" in bw:
        bw = {"read_GBps": 4000.0}
    res["models"] = []
    for label, build in (("laneformer-2b-shaped", lambda: (laneformer_2b_config(), None)),
                         ("default", default_model_config)):
        try:
            torch.cuda.empty_cache()
            cfg, src = build()
            if src is not None:
                from laneplay.engine.checkpoint import load_weights

                weights = load_weights(cfg, src, dtype=torch.float16, device=dev)
                src.close()
                name = cfg.name or label
            else:
                weights = random_weights(cfg, torch.float16, dev)
                name = cfg.name or label
            res["models"].append(decode_speed(name, cfg, weights, dev, bw, args.steps, args.prompt))
            del weights
        except Exception:
            res["models"].append({"model": label, "error": traceback.format_exc()})
            log(res["models"][-1]["error"])
        save()
    res["seconds"] = round(time.perf_counter() - t_all, 1)
    res.update(calibration(res))
    save()
    print_table(res)
    return 0


def print_table(res: dict) -> None:
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}  ({res['seconds']} s)")
    bw = res.get("bandwidth", {})
    print(f"copy {bw.get('copy_GBps')} GB/s (read+write), read {bw.get('read_GBps')} GB/s")
    ks = res.get("kernels", [])
    for k in sorted({r["kernel"] for r in ks}):
        rs = [r for r in ks if r["kernel"] == k]
        worst = {d: max(r["rel_err"] for r in rs if r["dtype"] == d) for d in ("float32", "float16", "bfloat16")}
        print(f"  {k:18s} {sum(r['ok'] for r in rs)}/{len(rs)} ok   worst rel err "
              + "  ".join(f"{d} {e:.1e}" for d, e in worst.items()))
    for m in res.get("models", []):
        if "variants" not in m:
            print(f"{m.get('model')}: failed")
            continue
        print(f"\n{m['model']}  ({m['bytes_per_token'] / 1e9:.3f} GB read per token, {m['dtype']})")
        print(f"  {'path':44s} {'ms/token':>9s} {'tok/s':>8s} {'GB/s':>7s} {'of read BW':>10s}")
        for label, v in m["variants"].items():
            print(f"  {label:44s} {v['ms_per_token']:9.3f} {v['tokens_per_s']:8.1f} {v['GBps']:7.0f} "
                  f"{v['share_of_read_bw']:10.0%}")
        if "parity_vs_decode" in m:
            p = m["parity_vs_decode"]
            print(f"  parity vs LaneModel.decode: max rel |Δlogit| {p['max_rel_dlogit']:.2e}, "
                  f"top-1 agreement {p['greedy_top1_agreement']:.0%}")


if __name__ == "__main__":
    sys.exit(main())
