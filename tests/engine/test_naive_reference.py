"""Sanity tests of the naive Laneformer reference (no engine involved)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from . import naive_reference as nr


# --------------------------------------------------------------------------------------------
# An independent dense Llama-style transformer (vectorised, complex-number RoPE, SDPA attention)
# --------------------------------------------------------------------------------------------


def _dense_freqs(config, hd):
    theta = float(config.get("rope_theta") or 10000.0)
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    sc = config.get("rope_scaling")
    if sc:
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        orig = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = (orig / wavelen - low) / (high - low)
        mid = (1 - smooth) * freqs / factor + smooth * freqs
        freqs = torch.where(wavelen > orig / low, freqs / factor,
                            torch.where(wavelen < orig / high, freqs, mid))
    return freqs


def _rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def dense_llama(config, sd, ids, *, residual_scale=1.0, lane=None):
    """Dense Llama forward with flat weights built from the lane layout (docs/laneformer.md §8 flattening).

    lane=None: all lanes flattened into one standard TP model.  lane=l: a dense model made of lane
    l's slices only.  Returns (hidden [B,S,D], logits [B,S,V] with a replicate-style head).
    """
    D, Hq, Hkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    L = config["num_lanes"]
    hd = config.get("head_dim") or D // Hq
    eps = config.get("norm_eps", 1e-5)
    if lane is not None:
        Hq, Hkv = Hq // L, Hkv // L

    def flat_in(w):  # [L, out/L, in] -> [out, in]
        return w[lane] if lane is not None else w.reshape(-1, w.shape[-1])

    def flat_out(w):  # [L, out, in/L] -> [out, in]
        return w[lane] if lane is not None else w.permute(1, 0, 2).reshape(w.shape[1], -1)

    B, S = ids.shape
    x = sd["model.tok_embeddings.weight"][ids].float()
    angles = torch.outer(torch.arange(S, dtype=torch.float64), _dense_freqs(config, hd))
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def rope(t):  # [B,S,H,hd]
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(tc * cis[None, :, None, :]).flatten(-2)

    swa = nr.swa_layer_set(config)
    W = config.get("sliding_window")
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xn = _rmsnorm(x, sd[p + "attention_norm.weight"], eps)
        q = (xn @ flat_in(sd[p + "attention.wq.weight"]).T).view(B, S, Hq, hd)
        k = (xn @ flat_in(sd[p + "attention.wk.weight"]).T).view(B, S, Hkv, hd)
        v = (xn @ flat_in(sd[p + "attention.wv.weight"]).T).view(B, S, Hkv, hd)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
        mask = causal
        if i in swa:
            mask = causal & (pos[None, :] > pos[:, None] - W)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask)
        o = att.transpose(1, 2).reshape(B, S, Hq * hd) @ flat_out(sd[p + "attention.wo.weight"]).T
        x = x + residual_scale * o
        xn = _rmsnorm(x, sd[p + "ffn_norm.weight"], eps)
        g = xn @ flat_in(sd[p + "feed_forward.w1.weight"]).T
        u = xn @ flat_in(sd[p + "feed_forward.w3.weight"]).T
        x = x + residual_scale * ((F.silu(g) * u) @ flat_out(sd[p + "feed_forward.w2.weight"]).T)
    logits = None
    if "lm_head.weight" in sd and sd["lm_head.weight"].dim() == 2:
        logits = _rmsnorm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T
    return x, logits


def _ids(config, B=2, S=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config["vocab_size"], (B, S), generator=gen)


def _close(a, b, atol=2e-5, rtol=2e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}


# --------------------------------------------------------------------------------------------
# (a) L = 1: every reduce mode is the identity, the model is a dense Llama
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,early,comm,elb", [
    (1, True, True, True), (1, False, True, True), (2, True, False, True), (2, False, True, False),
    (1, True, True, False), (3, False, False, True),
])
@pytest.mark.parametrize("swa,scaling", [(False, False), (True, False), (True, True)])
def test_single_lane_equals_dense_llama(d, early, comm, elb, swa, scaling):
    cfg = nr.tiny_config(num_lanes=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         num_hidden_layers=4, broadcast_delay=d, use_early_comm=early, use_comm=comm,
                         early_layers_broadcast=elb, rope_theta=500.0,
                         sliding_window=5 if swa else None, swa_layers=[0, 2] if swa else None,
                         rope_scaling=SCALING if scaling else None)
    sd = nr.random_laneformer(cfg, seed=1)
    ids = _ids(cfg, S=20)
    hidden, logits = dense_llama(cfg, sd, ids)
    _close(nr.naive_hidden_states(cfg, sd, ids)[:, :, 0], hidden)
    _close(nr.naive_logits(cfg, sd, ids), logits)


def test_single_lane_head_variants_agree():
    cfg = nr.tiny_config(num_lanes=1, num_hidden_layers=2, num_key_value_heads=2)
    sd = nr.random_laneformer(cfg, seed=2)
    ids = _ids(cfg)
    ref = nr.naive_logits(cfg, sd, ids)
    head = sd.pop("lm_head.weight")
    lane = dict(sd, **{"lm_head.linear.weight": head})
    _close(nr.naive_logits(dict(cfg, lm_head_type="lane"), lane, ids), ref)
    vp = dict(sd, **{"lm_head.weight": head[None]})
    _close(nr.naive_logits(dict(cfg, lm_head_type="vocab_parallel"), vp, ids), ref)


# --------------------------------------------------------------------------------------------
# d >= N with use_early_comm: every layer is PRESENT = ordinary tensor parallelism
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L,Hq,Hkv,D", [(4, 8, 4, 32), (8, 16, 8, 64), (2, 8, 2, 32)])
def test_all_present_equals_flat_dense_model(L, Hq, Hkv, D):
    cfg = nr.tiny_config(num_lanes=L, num_attention_heads=Hq, num_key_value_heads=Hkv, hidden_size=D,
                         intermediate_size=2 * D, num_hidden_layers=3, broadcast_delay=3,
                         use_early_comm=True, sliding_window=6, sliding_window_n_layers=-1)
    assert all(m == (nr.PRESENT, nr.PRESENT) for m in nr.reduce_modes(cfg))
    sd = nr.random_laneformer(cfg, seed=3)
    ids = _ids(cfg, S=16)
    hidden, logits = dense_llama(cfg, sd, ids)
    got = nr.naive_hidden_states(cfg, sd, ids)
    for lane in range(L):  # lanes stay identical copies
        _close(got[:, :, lane], hidden, atol=5e-5, rtol=5e-5)
    _close(nr.naive_logits(cfg, sd, ids), logits, atol=5e-5, rtol=5e-5)


def test_all_present_head_variants():
    L, V, D = 4, 64, 32
    base = nr.tiny_config(num_lanes=L, num_hidden_layers=2, broadcast_delay=2, vocab_size=V)
    sd = nr.random_laneformer(base, seed=4)
    ids = _ids(base)
    hidden = nr.naive_hidden_states(base, sd, ids)
    y = _rmsnorm(hidden[:, :, 0], sd["model.norm.weight"], 1e-5)
    # replicate
    _close(nr.naive_logits(base, sd, ids), y @ sd["lm_head.weight"].T)
    # pre_norm_lane_agg: RMSNorm(sum) = RMSNorm(L * h) ~= RMSNorm(h) for identical lanes
    _close(nr.naive_logits(dict(base, pre_norm_lane_agg=True), sd, ids), y @ sd["lm_head.weight"].T,
           atol=1e-4, rtol=1e-4)
    # lane head: sum_l W_l y
    gen = torch.Generator().manual_seed(5)
    wlane = torch.randn(V, L * D, generator=gen) / math.sqrt(L * D)
    sd_lane = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    sd_lane["lm_head.linear.weight"] = wlane
    expect = sum(y @ wlane[:, l * D:(l + 1) * D].T for l in range(L))
    _close(nr.naive_logits(dict(base, lm_head_type="lane"), sd_lane, ids), expect)
    # vocab_parallel: lane l gives rows l*V/L..(l+1)*V/L
    wvp = torch.randn(L, V // L, D, generator=gen) / math.sqrt(D)
    sd_vp = dict(sd, **{"lm_head.weight": wvp})
    _close(nr.naive_logits(dict(base, lm_head_type="vocab_parallel"), sd_vp, ids),
           y @ wvp.reshape(V, D).T)


# --------------------------------------------------------------------------------------------
# (b) NO_REDUCE everywhere: lanes are independent models with sqrt(L)-scaled residual adds
# --------------------------------------------------------------------------------------------


def _no_reduce_cfg(**kw):
    return nr.tiny_config(num_lanes=4, num_hidden_layers=3, broadcast_delay=1, use_comm=False,
                          use_early_comm=False, **kw)


def test_no_reduce_lanes_are_independent():
    cfg = _no_reduce_cfg(replicated_rmsn_scale=False, lm_head_type="vocab_parallel")
    assert all(m == (nr.NO_REDUCE, nr.NO_REDUCE) for m in nr.reduce_modes(cfg))
    sd = nr.random_laneformer(cfg, seed=6)
    ids = _ids(cfg)
    before = nr.naive_hidden_states(cfg, sd, ids)
    logits_before = nr.naive_logits(cfg, sd, ids)
    sd2 = dict(sd)
    for key in list(sd2):
        if key.startswith("model.layers.") and sd2[key].dim() >= 2:
            w = sd2[key].clone()
            w[3] = torch.randn_like(w[3])
            sd2[key] = w
    after = nr.naive_hidden_states(cfg, sd2, ids)
    logits_after = nr.naive_logits(cfg, sd2, ids)
    assert torch.equal(before[:, :, :3], after[:, :, :3])
    assert not torch.allclose(before[:, :, 3], after[:, :, 3])
    v4 = cfg["vocab_size"] // 4
    assert torch.equal(logits_before[..., :3 * v4], logits_after[..., :3 * v4])
    assert not torch.allclose(logits_before[..., 3 * v4:], logits_after[..., 3 * v4:])


def test_no_reduce_lane_is_dense_model_with_sqrt_l_residual():
    cfg = _no_reduce_cfg(sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                        "sliding_attention"])
    sd = nr.random_laneformer(cfg, seed=7)
    ids = _ids(cfg, S=14)
    got = nr.naive_hidden_states(cfg, sd, ids)
    for lane in range(4):
        hidden, _ = dense_llama(cfg, sd, ids, residual_scale=2.0, lane=lane)  # sqrt(4) = 2
        _close(got[:, :, lane], hidden)


# --------------------------------------------------------------------------------------------
# Reduce modes and the delayed pasts, checked on the recorded per-layer partials
# --------------------------------------------------------------------------------------------


def _expected_modes(N, d, early, attn_comm, mlp_comm):
    out = []
    for i in range(N):
        if i < d:
            m = "PRESENT" if early else "NO_REDUCE"
            out.append((m, m))
        else:
            out.append(("PAST" if attn_comm else "NO_REDUCE", "PAST" if mlp_comm else "NO_REDUCE"))
    return out


def _expected_reduce(mode, x, past, L):
    if mode == "NO_REDUCE":
        return x * math.sqrt(L)
    if mode == "PRESENT":
        return x.sum(dim=2, keepdim=True).expand_as(x)
    return x + (past.sum(dim=2, keepdim=True) - past)


CASES = [dict(d=d, early=e, comm=c, elb=b, attn=a, mlp=m)
         for d, e, c, b, (a, m) in itertools.product(
             (1, 2), (True, False), (True, False), (True, False),
             ((None, None), (False, None), (None, False), (True, False)))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_reduce_equations(case):
    N, L = 5, 4
    cfg = nr.tiny_config(num_lanes=L, num_hidden_layers=N, broadcast_delay=case["d"],
                         use_early_comm=case["early"], use_comm=case["comm"],
                         early_layers_broadcast=case["elb"], replicated_rmsn_scale=False)
    if case["attn"] is not None:
        cfg["use_attention_comm"] = case["attn"]
    if case["mlp"] is not None:
        cfg["use_mlp_comm"] = case["mlp"]
    attn_comm = case["comm"] if case["attn"] is None else case["attn"]
    mlp_comm = case["comm"] if case["mlp"] is None else case["mlp"]
    modes = _expected_modes(N, case["d"], case["early"], attn_comm, mlp_comm)
    assert nr.reduce_modes(cfg) == modes

    sd = nr.random_laneformer(cfg, seed=8)
    tr = nr.naive_trace(cfg, sd, _ids(cfg, S=6))
    d = case["d"]
    zero = torch.zeros_like(tr["attn_out"][0])
    for i in range(N):
        src = i - d
        visible = src >= 0 and (src >= d or case["elb"])
        past_a = tr["attn_out"][src] if visible else zero
        past_m = tr["mlp_out"][src] if visible else zero
        _close(tr["h_mid"][i], tr["h_in"][i] + _expected_reduce(modes[i][0], tr["attn_out"][i], past_a, L))
        _close(tr["h_out"][i], tr["h_mid"][i] + _expected_reduce(modes[i][1], tr["mlp_out"][i], past_m, L))
    # Lanes start identical and diverge unless everything is PRESENT.
    assert torch.equal(tr["h_in"][0][:, :, 0], tr["h_in"][0][:, :, 1])
    assert not torch.allclose(tr["hidden"][:, :, 0], tr["hidden"][:, :, 1])


def test_double_count_quirk_by_hand():
    """d=1, early comm: layer 1 adds own partial + the other lanes' layer-0 partials (again)."""
    L = 2
    cfg = nr.tiny_config(num_lanes=L, num_hidden_layers=2, broadcast_delay=1, use_early_comm=True)
    sd = nr.random_laneformer(cfg, seed=9)
    ids = _ids(cfg, S=5)
    tr = nr.naive_trace(cfg, sd, ids)
    a0, a1 = tr["attn_out"][0], tr["attn_out"][1]
    h1 = tr["h_in"][1]
    # lane 0: own layer-1 partial + lane 1's layer-0 partial (already summed in by PRESENT at layer 0)
    _close(tr["h_mid"][1][:, :, 0], h1[:, :, 0] + a1[:, :, 0] + a0[:, :, 1])
    _close(tr["h_mid"][1][:, :, 1], h1[:, :, 1] + a1[:, :, 1] + a0[:, :, 0])
    # Newer revision: no broadcast from layers < d -> layer 1 adds only its own partial.
    tr2 = nr.naive_trace(dict(cfg, early_layers_broadcast=False), sd, ids)
    _close(tr2["h_mid"][1], tr2["h_in"][1] + tr2["attn_out"][1])
    assert not torch.allclose(tr["logits"], tr2["logits"])


# --------------------------------------------------------------------------------------------
# (c) causality and (d) sliding window
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["replicate", "lane", "vocab_parallel"])
def test_causality(head):
    cfg = nr.tiny_config(num_lanes=4, num_hidden_layers=3, broadcast_delay=1, lm_head_type=head,
                         sliding_window=3, sliding_window_n_layers=1)
    sd = nr.random_laneformer(cfg, seed=10)
    ids = _ids(cfg, B=1, S=15)
    ref = nr.naive_logits(cfg, sd, ids)
    for p in (0, 6, 13):
        ids2 = ids.clone()
        ids2[:, p + 1:] = (ids2[:, p + 1:] + 7) % cfg["vocab_size"]
        out = nr.naive_logits(cfg, sd, ids2)
        assert torch.equal(out[:, :p + 1], ref[:, :p + 1])
        assert not torch.allclose(out[:, p + 1:], ref[:, p + 1:])


def test_sliding_window_single_layer():
    W = 4
    cfg = nr.tiny_config(num_lanes=2, num_hidden_layers=1, sliding_window=W,
                         layer_types=["sliding_attention"])
    full_cfg = dict(cfg, layer_types=["full_attention"])
    sd = nr.random_laneformer(cfg, seed=11)
    ids = _ids(cfg, B=1, S=16)
    ref = nr.naive_logits(cfg, sd, ids)
    full = nr.naive_logits(full_cfg, sd, ids)
    # Up to W tokens the window covers everything.
    _close(ref[:, :W], full[:, :W])
    assert not torch.allclose(ref[:, W:], full[:, W:])
    p = 12
    ids_old = ids.clone()
    ids_old[:, :p - W + 1] = (ids_old[:, :p - W + 1] + 5) % cfg["vocab_size"]  # positions <= p-W
    out = nr.naive_logits(cfg, sd, ids_old)
    assert torch.equal(out[:, p:], ref[:, p:])
    ids_in = ids.clone()
    ids_in[:, p - W + 1] = (ids_in[:, p - W + 1] + 5) % cfg["vocab_size"]  # oldest in-window key
    assert not torch.allclose(nr.naive_logits(cfg, sd, ids_in)[:, p], ref[:, p])


def test_sliding_window_null_disables_swa():
    cfg = nr.tiny_config(num_hidden_layers=2, sliding_window=None, swa_layers=[0, 1])
    assert nr.swa_layer_set(cfg) == set()


# --------------------------------------------------------------------------------------------
# (e) RoPE
# --------------------------------------------------------------------------------------------


def test_rope_scaling_formula():
    hd = 96
    plain = nr.rope_frequencies({"rope_theta": 1e4}, hd)
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    scaled = nr.rope_frequencies({"rope_theta": 1e4, "rope_scaling": sc}, hd)
    _close(plain, torch.tensor([1e4 ** (-2 * t / hd) for t in range(hd // 2)], dtype=torch.float64))
    assert scaled[0] == plain[0] == 1.0  # highest frequency untouched
    _close(scaled[-1], plain[-1] / 8)  # lowest frequency divided by factor
    changed = (scaled != plain).nonzero().flatten().tolist()
    assert changed == list(range(31, 48))  # docs/laneformer.md §6: 17 of 48 change, all wavelengths > 2048
    wavelen = 2 * math.pi / plain
    assert bool((wavelen[changed] > 2048).all()) and bool((wavelen[:31] < 2048).all())
    # one smooth-band value by hand
    t = next(t for t in changed if 2048 < wavelen[t] < 8192)
    s = (8192 / wavelen[t] - 1) / (4 - 1)
    _close(scaled[t], (1 - s) * plain[t] / 8 + s * plain[t])
    assert plain[t] / 8 < scaled[t] < plain[t]
    # agrees with the vectorised formula used by the dense model
    _close(scaled, _dense_freqs({"rope_theta": 1e4, "rope_scaling": sc}, hd))


def test_rope_interleaved_pairs_and_relative_positions():
    hd, S = 8, 10
    gen = torch.Generator().manual_seed(12)
    cfg = {"rope_theta": 100.0}
    cos, sin = nr._rope_cos_sin(cfg, hd, S)
    x = torch.randn(2, S, hd, generator=gen)
    out = nr.apply_rope_interleaved(x, cos, sin)
    angles = torch.outer(torch.arange(S, dtype=torch.float64), nr.rope_frequencies(cfg, hd))
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    _close(out[..., 0::2], z.real)
    _close(out[..., 1::2], z.imag)
    assert torch.equal(out[:, 0], x[:, 0])  # position 0 is not rotated
    # same vectors at every position: scores depend on p - j only
    q = torch.randn(hd, generator=gen).expand(1, S, hd)
    k = torch.randn(hd, generator=gen).expand(1, S, hd)
    qr, kr = nr.apply_rope_interleaved(q, cos, sin)[0], nr.apply_rope_interleaved(k, cos, sin)[0]
    scores = qr @ kr.T
    for delta in range(3):
        diag = torch.diagonal(scores, offset=-delta)
        _close(diag, diag[0].expand_as(diag), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# (f) SWA layer selection conventions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,expected", [
    ({}, set()),
    ({"sliding_window_n_layers": 0}, set()),
    ({"sliding_window_n_layers": 3}, {0, 1, 2}),
    ({"sliding_window_n_layers": -2}, {4, 5}),
    ({"sliding_window_n_layers": 4, "unclamped_layers": [1, 5]}, {0, 2, 3}),
    ({"sliding_window_n_layers": -3, "unclamped_layers": [4]}, {3, 5}),
    ({"sliding_window_n_layers": 9}, {0, 1, 2, 3, 4, 5}),
    ({"swa_layers": [0, 2, 4]}, {0, 2, 4}),
    ({"swa_layers": [], "sliding_window_n_layers": 3}, set()),
    ({"layer_types": ["sliding_attention", "full_attention"] * 3}, {0, 2, 4}),
    ({"layer_types": ["full_attention"] * 5 + ["sliding_attention"], "swa_layers": [0, 1],
      "sliding_window_n_layers": 2}, {5}),
    ({"swa_layers": [1], "sliding_window_n_layers": 3, "unclamped_layers": [1]}, {1}),
])
def test_swa_layer_set(extra, expected):
    cfg = dict(nr.tiny_config(num_hidden_layers=6, sliding_window=8), **extra)
    assert nr.swa_layer_set(cfg) == expected


def test_released_model_swa_layers():
    cfg = {"num_hidden_layers": 15, "sliding_window": 2048, "sliding_window_n_layers": 10}
    assert nr.swa_layer_set(cfg) == set(range(10))
    assert nr.swa_layer_set({"num_hidden_layers": 15, "sliding_window": 2048,
                             "swa_layers": list(range(10))}) == set(range(10))


# --------------------------------------------------------------------------------------------
# Norm variants, defaults, helpers, validation
# --------------------------------------------------------------------------------------------


def test_lane_norm_with_equal_scales_equals_replicated_norm():
    cfg = nr.tiny_config(num_lanes=4, num_hidden_layers=3, broadcast_delay=1)
    sd = nr.random_laneformer(cfg, seed=13)
    lane_sd = {}
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            lane_sd[k[:-len("weight")] + "scale"] = v.expand(4, -1).clone()
        else:
            lane_sd[k] = v
    ids = _ids(cfg)
    _close(nr.naive_logits(dict(cfg, replicated_rmsn_scale=False), lane_sd, ids),
           nr.naive_logits(cfg, sd, ids))


def test_lane_norm_scales_matter():
    cfg = nr.tiny_config(num_lanes=4, num_hidden_layers=2, replicated_rmsn_scale=False)
    sd = nr.random_laneformer(cfg, seed=14)
    assert sd["model.layers.0.attention_norm.scale"].shape == (4, 32)
    ids = _ids(cfg)
    sd2 = dict(sd)
    s = sd2["model.layers.1.ffn_norm.scale"].clone()
    s[2] *= 1.5
    sd2["model.layers.1.ffn_norm.scale"] = s
    h1, h2 = nr.naive_hidden_states(cfg, sd, ids), nr.naive_hidden_states(cfg, sd2, ids)
    assert not torch.allclose(h1[:, :, 2], h2[:, :, 2])
    # layer 1 >= d uses PAST, whose "others" come from layer 0: lane 0 is unaffected at the end
    assert torch.equal(h1[:, :, 0], h2[:, :, 0])


def test_defaults_and_eps_fallback():
    full = nr.tiny_config(num_hidden_layers=2, norm_eps=1e-3)
    minimal = {k: full[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "num_lanes", "broadcast_delay")}
    sd = nr.random_laneformer(full, seed=15)
    ids = _ids(full)
    ref = nr.naive_logits(full, sd, ids)
    _close(nr.naive_logits(dict(minimal, rms_norm_eps=1e-3), sd, ids), ref)
    _close(nr.naive_logits(dict(minimal, norm_eps=1e-3, rms_norm_eps=0.5), sd, ids), ref)
    assert not torch.allclose(nr.naive_logits(minimal, sd, ids), ref)  # default eps 1e-5


def test_explicit_head_dim():
    cfg = nr.tiny_config(num_lanes=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=12, num_hidden_layers=2)
    sd = nr.random_laneformer(cfg, seed=16)
    assert sd["model.layers.0.attention.wq.weight"].shape == (2, 24, 32)
    assert sd["model.layers.0.attention.wo.weight"].shape == (2, 32, 24)
    assert nr.naive_logits(cfg, sd, _ids(cfg)).shape == (2, 12, cfg["vocab_size"])


@pytest.mark.parametrize("head", ["replicate", "lane", "vocab_parallel"])
@pytest.mark.parametrize("lane_norm", [False, True])
def test_random_laneformer_layout_and_scale(head, lane_norm):
    cfg = nr.tiny_config(num_lanes=8, num_attention_heads=16, num_key_value_heads=8, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=6, broadcast_delay=2,
                         lm_head_type=head, replicated_rmsn_scale=not lane_norm)
    sd = nr.random_laneformer(cfg, seed=17)
    assert torch.equal(sd["model.tok_embeddings.weight"],
                       nr.random_laneformer(cfg, seed=17)["model.tok_embeddings.weight"])
    assert sd["model.layers.5.attention.wq.weight"].shape == (8, 8, 64)  # hd = 4
    assert sd["model.layers.5.attention.wk.weight"].shape == (8, 4, 64)
    assert sd["model.layers.5.feed_forward.w2.weight"].shape == (8, 64, 16)
    head_key = {"replicate": "lm_head.weight", "lane": "lm_head.linear.weight",
                "vocab_parallel": "lm_head.weight"}[head]
    head_shape = {"replicate": (64, 64), "lane": (64, 512), "vocab_parallel": (8, 8, 64)}[head]
    assert sd[head_key].shape == head_shape
    assert ("model.norm.scale" in sd) == lane_norm
    ids = _ids(cfg, S=40)
    logits = nr.naive_logits(cfg, sd, ids)
    assert logits.shape == (2, 40, 64) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.2 < logits.std().item() < 10.0
    # bf16 weights are accepted and computed in fp32
    sd16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    assert nr.naive_logits(cfg, sd16, ids).dtype == torch.float32


@pytest.mark.parametrize("bad", [
    {"broadcast_delay": 0},
    {"lm_head_type": "lane", "pre_norm_lane_agg": True},
    {"lm_head_type": "tied"},
    {"num_key_value_heads": 2},  # not divisible by 4 lanes
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
])
def test_invalid_configs_rejected(bad):
    cfg = dict(nr.tiny_config(num_hidden_layers=1), **bad)
    sd = nr.random_laneformer(nr.tiny_config(num_hidden_layers=1), seed=0)
    with pytest.raises((ValueError, NotImplementedError)):
        nr.naive_logits(cfg, sd, _ids(cfg))


def test_wrong_shape_or_missing_key_rejected():
    cfg = nr.tiny_config(num_hidden_layers=1)
    sd = nr.random_laneformer(cfg, seed=0)
    flat = dict(sd, **{"model.layers.0.attention.wq.weight":
                       sd["model.layers.0.attention.wq.weight"].reshape(-1, 32)})
    with pytest.raises(ValueError):
        nr.naive_logits(cfg, flat, _ids(cfg))
    with pytest.raises(KeyError):
        nr.naive_logits(dict(cfg, replicated_rmsn_scale=False), sd, _ids(cfg))
