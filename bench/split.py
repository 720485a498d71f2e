"""Where a decode step's time goes: the weight products, the attention, and everything else.

`decode_split(engine, prompt_ids)` times, on the engine's own model and a real KV cache filled by the
prompt: the whole decode step (`LaneModel.decode`), the step's weight products alone (every layer's
projections and the LM head, on random inputs of the right shapes), and the attention alone (RoPE,
the cache write and attention over the visible slots, every layer); "other" is what remains: norms,
residual updates, the embedding row, Python between calls (never below 0). For the low-bit path the
parts are timed through the same C functions the step uses, one Python call each; when the whole step
is one C call (a one-lane model, `engine.lowbit_step.DecodeStep`) those per-call costs are not in the step,
so its parts can add up to more than it and "other" reads 0. For the float path the parts are the
torch functions the step runs (uncompiled: in a compiled engine they are fused with their neighbours,
so its split is indicative).
"""
from __future__ import annotations

import time

import torch

from laneplay.bench.common import median


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * median(times)


def weight_products(m):
    """A function that runs one decode step's weight products of model `m` (every layer's projections
    and the LM head) on random inputs of the right shapes."""
    from laneplay.engine.model import lane_linear, linear

    mats = [w for lw in m.layers for w in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
    xs = [torch.randn(w.shape[0], 1, 1, w.shape[-1], dtype=m.dtype) for w in mats]
    head_x = torch.randn(1, m.head_weight.shape[-1], dtype=m.dtype)

    def run():
        for x, w in zip(xs, mats):
            lane_linear(x, w)
        linear(head_x, m.head_weight)

    return run


@torch.inference_mode()
def decode_split(eng, ids: list[int], reps: int = 20) -> dict:
    from laneplay.engine.model import apply_rope, decode_attention

    m, cfg = eng.model, eng.cfg
    n_ids = len(ids)
    _, cache = m.prefill(torch.tensor([ids]), 1, n_ids + reps + 8)
    pos = [n_ids]
    tok = torch.tensor([[ids[-1]]])

    def step():
        m.decode(tok, pos[0], cache)
        pos[0] += 1

    step_ms = time_ms(step, reps)
    matrices = weight_products(m)
    L, hq, hkv, hd = len(m.lanes), cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.head_dim
    p = pos[0] - 1
    cos, sin = m.cos[p:p + 1], m.sin[p:p + 1]
    qkv = torch.randn(L, (hq + 2 * hkv) * hd, dtype=m.dtype)
    if m.lowbit:
        from laneplay.kernels import lowbit

        def attention():
            for i in range(cfg.num_layers):
                slots = cache.slots[i]
                lowbit.attend(qkv.clone(), cos.view(-1), sin.view(-1), cache.k[i], cache.v[i], p % slots,
                              min(p + 1, slots), hq, hkv)
    else:
        def attention():
            for i in range(cfg.num_layers):
                slots = cache.slots[i]
                q, k, v = qkv.view(L, 1, -1).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
                q = apply_rope(q.reshape(L, 1, hq, hd), cos, sin).transpose(1, 2)
                k = apply_rope(k.reshape(L, 1, hkv, hd), cos, sin).transpose(1, 2)
                slot = torch.tensor([p % slots])
                cache.k[i].index_copy_(2, slot, k)
                cache.v[i].index_copy_(2, slot, v.reshape(L, 1, hkv, hd).transpose(1, 2))
                n = min(p + 1, slots)
                decode_attention(q, cache.k[i][:, :, :n], cache.v[i][:, :, :n])

    mat_ms, att_ms = time_ms(matrices, reps), time_ms(attention, reps)
    return {"step_ms": step_ms, "matrices_ms": mat_ms, "attention_ms": att_ms,
            "other_ms": max(0.0, step_ms - mat_ms - att_ms), "context": p + 1}
