"""Every Triton kernel against its plain-torch reference, under TRITON_INTERPRET=1, fp32 and fp16.

(bf16 arithmetic is wrong in the interpreter, so bf16 is left to `bench/gpu_check.py` on a GPU.)
Inputs are fresh random numbers and outputs are poisoned first, so an unwritten element fails.
"""
import pytest
import torch

from laneplay.kernels import ops, reference
from laneplay.kernels import triton_kernels as tk

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}  # relative to the reference's scale


def rel_err(got, ref):
    assert torch.isfinite(got.float()).all(), "non-finite output (unwritten or NaN)"
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def rnd(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D,lanes,out", [(1, 64, None, None), (3, 96, None, "f32"), (8, 40, 4, None),
                                              (6, 576, 2, "f16")])
def test_rms_norm(dtype, rows, D, lanes, out):
    x = rnd(rows, D, dtype=dtype, seed=rows + D)
    w = (1 + 0.1 * rnd(*((lanes, D) if lanes else (D,)), dtype=torch.float32, seed=7)).to(dtype)
    od = {"f32": torch.float32, "f16": torch.float16, None: None}[out]
    got = ops.rms_norm(x, w, 1e-5, od, impl="triton")
    ref = reference.rms_norm(x, w, 1e-5, od)
    assert got.dtype == ref.dtype == (od or dtype)
    assert rel_err(got, ref) <= TOL[dtype]


def _rope_case(dtype, N, hq, hkv, hd, slots, pos, seed):
    qkv = rnd(N, (hq + 2 * hkv) * hd, dtype=dtype, seed=seed)
    from laneplay.engine.config import ModelConfig
    from laneplay.engine.model import rope_tables

    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=hq * hd, intermediate_size=8, num_layers=1,
                      num_heads=hq, num_kv_heads=hkv, head_dim=hd)
    cos, sin = rope_tables(cfg, 64)
    caches = [rnd(N, hkv, slots, hd, dtype=dtype, seed=seed + i) for i in range(2)]
    return qkv, cos, sin, torch.tensor([pos]), caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,hq,hkv,hd,slots,pos", [(1, 4, 2, 96, 16, 3), (6, 9, 3, 64, 8, 21),  # ring wrapped
                                                   (2, 2, 2, 10, 40, 39), (3, 4, 1, 16, 5, 5)])
def test_rope_kv_write(dtype, N, hq, hkv, hd, slots, pos):
    qkv, cos, sin, p, (kc, vc) = _rope_case(dtype, N, hq, hkv, hd, slots, pos, seed=N * hd)
    kr, vr = kc.clone(), vc.clone()
    q = ops.rope_kv_write(qkv, cos, sin, p, kc, vc, hq, hkv, hd, impl="triton")
    qr = reference.rope_kv_write(qkv, cos, sin, p, kr, vr, hq, hkv, hd)
    assert rel_err(q, qr) <= TOL[dtype]
    assert rel_err(kc, kr) <= TOL[dtype] and torch.equal(vc, vr)
    untouched = [s for s in range(slots) if s != pos % slots]
    assert torch.equal(kc[:, :, untouched], kr[:, :, untouched])  # only the slot of pos was written


def test_rope_matches_the_models_rotation():
    from laneplay.engine.model import apply_rope

    qkv, cos, sin, p, (kc, vc) = _rope_case(torch.float32, 2, 4, 2, 8, 16, 11, seed=3)
    q = ops.rope_kv_write(qkv, cos, sin, p, kc, vc, 4, 2, 8, impl="triton")
    model_q = apply_rope(qkv.view(2, 1, 8, 8)[:, :, :4], cos[11:12], sin[11:12])[:, 0]
    assert rel_err(q, model_q) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,hq,hkv,hd,slots,pos,window", [
    (1, 4, 2, 96, 64, 5, None),     # sequence shorter than one block
    (2, 4, 2, 64, 300, 270, None),  # several splits (more than the merge's chunk of 16), the last partly filled
    (3, 9, 3, 64, 16, 40, 16),      # ring buffer wrapped (GQA group of 3)
    (2, 2, 1, 32, 24, 30, 16),      # ring larger than the window: positions past the window are masked
    (4, 4, 4, 16, 8, 7, 8),         # batch > 1, ring exactly full
])
def test_decode_attention(dtype, N, hq, hkv, hd, slots, pos, window):
    q = rnd(N, hq, hd, dtype=dtype, seed=pos)
    kc = rnd(N, hkv, slots, hd, dtype=dtype, seed=pos + 1)
    vc = rnd(N, hkv, slots, hd, dtype=dtype, seed=pos + 2)
    p = torch.tensor([pos])
    ref = reference.decode_attention(q, kc, vc, p, window)
    for config in (None, tk.ATTENTION_CONFIGS[2], tk.ATTENTION_CONFIGS[-1]):  # default, short and long splits
        got = ops.decode_attention(q, kc, vc, p, window, impl="triton", config=config)
        assert rel_err(got, ref) <= (3e-5 if dtype == torch.float32 else 5e-3), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,hq,hkv,hd,slots,pos,window,config", [
    (1, 4, 2, 96, 64, 5, None, None),           # the slot of pos in the first split
    (2, 6, 3, 64, 80, 60, None, (16, 16, 2)),   # several splits; only one owns the slot of pos
    (3, 9, 3, 32, 16, 40, 16, None),            # ring buffer wrapped
    (2, 2, 1, 16, 24, 30, 16, (32, 16, 2)),     # ring larger than the window
])
def test_rope_attention_fused(dtype, N, hq, hkv, hd, slots, pos, window, config):
    qkv, cos, sin, p, (kc, vc) = _rope_case(dtype, N, hq, hkv, hd, slots, pos, seed=pos + hd)
    kr, vr = kc.clone(), vc.clone()
    kc[:, :, pos % slots] = vc[:, :, pos % slots] = float("nan")  # the kernel must write this slot
    got = ops.rope_attention(qkv, cos, sin, p, kc, vc, hq, hkv, hd, window, impl="triton", config=config)
    ref = reference.rope_attention(qkv, cos, sin, p, kr, vr, hq, hkv, hd, window)
    assert rel_err(got, ref) <= (3e-5 if dtype == torch.float32 else 5e-3)
    assert rel_err(kc, kr) <= TOL[dtype] and torch.equal(vc, vr)


def _rows_match(fused, case, cache_rows, alone, alone_k, alone_v):
    """The Triton kernels and the torch reference, fused or as the two kernels, on copies of the caches:
    the rows' outputs and the caches they leave are those of the rows' own steps (alone, alone_k/v)."""
    qkv, cos, sin, pos, kc, vc, hq, hkv, hd, window = case
    for impl in ("triton", "torch"):
        k, v = kc.clone(), vc.clone()
        if fused:
            got = ops.rope_attention(qkv, cos, sin, pos, k, v, hq, hkv, hd, window, impl=impl, cache_rows=cache_rows)
        else:
            q = ops.rope_kv_write(qkv, cos, sin, pos, k, v, hq, hkv, hd, impl=impl, cache_rows=cache_rows)
            got = ops.decode_attention(q, k, v, pos, window, impl=impl, cache_rows=cache_rows)
        assert rel_err(got, alone) <= 3e-5, impl
        assert rel_err(k, alone_k) <= 1e-6 and torch.equal(v, alone_v), impl


@pytest.mark.parametrize("fused,pool", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("slots,window,positions", [
    (48, None, [3, 40, 17, 0]),       # a full layer: each row sees its own prefix
    (8, 8, [5, 30, 9, 12]),           # ring buffers: one not yet full, the others wrapped
    (16, 8, [2, 21, 15, 7]),          # a ring larger than the window
])
def test_one_position_per_row_is_each_rows_own_step(fused, pool, slots, window, positions):
    """Separate requests in one step (the CUDA step's batch buckets): row n at positions[n] writes and
    reads its own cache row as a step of its own at that position would, in the Triton kernels and the
    torch reference alike. pool: two lanes of two rows each, in a pool of three cache rows per lane (row
    lane * 2 + i is cache row lane * 3 + i; the pool's third rows stay as they were)."""
    N, hq, hkv, hd = len(positions), 4, 2, 16
    cache_rows = (2, 3) if pool else None
    own = [n // 2 * 3 + n % 2 for n in range(N)] if pool else list(range(N))  # each row's cache row
    qkv, cos, sin, _, (kc, vc) = _rope_case(torch.float32, 6 if pool else N, hq, hkv, hd, slots, 0, seed=slots)
    qkv = qkv[:N]
    per_row = torch.tensor(positions)
    alone_k, alone_v, alone = kc.clone(), vc.clone(), []
    for n, pos in enumerate(positions):  # each row as a step of its own
        k1, v1 = alone_k[own[n]:own[n] + 1], alone_v[own[n]:own[n] + 1]
        alone.append(reference.rope_attention(qkv[n:n + 1], cos, sin, torch.tensor([pos]), k1, v1, hq, hkv, hd, window))
    alone = torch.cat(alone)
    _rows_match(fused, (qkv, cos, sin, per_row, kc, vc, hq, hkv, hd, window), cache_rows, alone, alone_k, alone_v)
    with pytest.raises(ValueError, match="one per row"):
        ops.decode_attention(qkv.view(N, -1, hd)[:, :hq], kc, vc, per_row[:2], window, impl="triton",
                             cache_rows=cache_rows)


@pytest.mark.parametrize("fused,slots,window,start,S", [
    (False, 48, None, 20, 5),   # a full layer: row j sees the rows before it and not those after
    (False, 12, 8, 3, 4),       # a ring of the window plus 4 spare slots, not yet full
    (True, 12, 8, 26, 4),       # the same ring wrapped: the later rows' writes land out of the earlier rows' window
    (False, 20, 8, 40, 12),     # 12 positions at once into a ring of 8 + 12 slots
])
def test_rows_sharing_a_cache_row_are_consecutive_steps(fused, slots, window, start, S):
    """A verify's positions (the CUDA step's verify graphs): S rows of one request, given their cache row
    one per row, at positions start..start+S-1, write every key before any row attends, and row j
    gives what the j-th of S steps of its own gives. The request is cache row 1 of a pool of 3 per lane
    (two lanes); the other cache rows stay as they were. In a ring, the spare slots beyond the window keep
    the rows' own writes out of each other's windows."""
    hq, hkv, hd, L, c = 4, 2, 16, 2, 3
    qkv, cos, sin, _, (kc, vc) = _rope_case(torch.float32, L * c, hq, hkv, hd, slots, 0, seed=slots + S)
    qkv = qkv[:1].repeat(L * S, 1) + rnd(L * S, qkv.shape[1], dtype=torch.float32, seed=S)
    pos = torch.arange(start, start + S).repeat(L)
    rows = torch.tensor([lane * c + 1 for lane in range(L) for _ in range(S)])
    alone_k, alone_v, alone = kc.clone(), vc.clone(), []
    for lane in range(L):
        for j in range(S):  # one step after another
            r, row = lane * S + j, lane * c + 1
            alone.append(reference.rope_attention(qkv[r:r + 1], cos, sin, pos[r:r + 1], alone_k[row:row + 1],
                                                  alone_v[row:row + 1], hq, hkv, hd, window))
    alone = torch.cat(alone)
    _rows_match(fused, (qkv, cos, sin, pos, kc, vc, hq, hkv, hd, window), rows, alone, alone_k, alone_v)
    with pytest.raises(ValueError, match="cache row per row"):
        ops.decode_attention(qkv.view(L * S, -1, hd)[:, :hq], kc, vc, pos, window, impl="triton", cache_rows=rows[1:])


def test_decode_attention_reads_only_visible_slots():
    # poison every slot that must not be read: the result stays finite and unchanged
    q = rnd(1, 2, 16, dtype=torch.float32, seed=1)
    kc, vc = rnd(1, 1, 32, 16, dtype=torch.float32, seed=2), rnd(1, 1, 32, 16, dtype=torch.float32, seed=3)
    p = torch.tensor([9])
    clean = ops.decode_attention(q, kc, vc, p, None, impl="triton")
    kc[:, :, 10:], vc[:, :, 10:] = float("nan"), float("nan")
    assert torch.equal(ops.decode_attention(q, kc, vc, p, None, impl="triton"), clean)
    ring_k, ring_v = kc[:, :, :8].clone(), vc[:, :, :8].clone()  # ring of 8, window 4 at pos 9: slots 6,7,0,1
    ring_k[:, :, 2:6], ring_v[:, :, 2:6] = float("nan"), float("nan")
    got = ops.decode_attention(q, ring_k, ring_v, p, 4, impl="triton")
    assert torch.isfinite(got).all()
    assert rel_err(got, reference.decode_attention(q, ring_k.nan_to_num(), ring_v.nan_to_num(), p, 4)) <= 3e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,F", [(1, 48), (8, 1536), (5, 1000)])
def test_swiglu(dtype, R, F):
    gu = rnd(R, 2 * F, dtype=dtype, seed=F)
    assert rel_err(ops.swiglu(gu, impl="triton"), reference.swiglu(gu)) <= TOL[dtype]


CASES = {  # the reduce modes of docs/laneformer.md §4
    "present": dict(present=True), "present+future": dict(present=True, want_sum=True),
    "no_reduce": dict(scale=8 ** 0.5, want_sum=True), "past": dict(past=True, want_sum=True),
    "past, last layers": dict(past=True), "own only": dict(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("L,B,D,lane_norm", [(8, 1, 96, False), (4, 3, 40, True), (1, 2, 64, False)])
def test_residual_update(dtype, case, L, B, D, lane_norm):
    kw = dict(CASES[case])
    h, x = rnd(L, B, D, dtype=dtype, seed=1), rnd(L, B, D, dtype=dtype, seed=2)
    if kw.pop("past", False):
        past = rnd(L, B, D, dtype=dtype, seed=3)
        kw.update(past=past, total_old=past.float().sum(0).to(dtype))
    nw = (1 + 0.1 * rnd(*((L, D) if lane_norm else (D,)), dtype=torch.float32, seed=4)).to(dtype)
    kw.update(norm_weight=nw, eps=1e-5)
    out = torch.full_like(h, float("nan"))
    got_h, got_s, got_n = ops.residual_update(h, x, impl="triton", out=out, **kw)
    ref_h, ref_s, ref_n = reference.residual_update(h, x, **kw)
    assert got_h.data_ptr() == out.data_ptr()
    assert rel_err(got_h, ref_h) <= TOL[dtype] and rel_err(got_n, ref_n) <= TOL[dtype]
    assert (got_s is None) == (ref_s is None)
    if ref_s is not None:
        assert rel_err(got_s, ref_s) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_update_with_a_total_from_elsewhere(dtype):
    # a DTP rank: PRESENT adds the all-reduced sum over every rank's lanes, not its own lanes' sum
    h, x = rnd(2, 3, 40, dtype=dtype, seed=7), rnd(2, 3, 40, dtype=dtype, seed=8)
    total = rnd(3, 40, dtype=dtype, seed=9)
    nw = (1 + 0.1 * rnd(40, dtype=torch.float32, seed=4)).to(dtype)
    got_h, got_s, got_n = ops.residual_update(h, x, impl="triton", present=True, total=total, norm_weight=nw)
    ref_h, ref_s, ref_n = reference.residual_update(h, x, present=True, total=total, norm_weight=nw)
    assert rel_err(got_h, ref_h) <= TOL[dtype] and rel_err(got_n, ref_n) <= TOL[dtype]
    assert rel_err(got_h, h.float() + total.float()) <= TOL[dtype] and torch.equal(got_s, total)


def test_residual_update_in_place_without_norm():
    h, x = rnd(2, 1, 32, dtype=torch.float32, seed=5), rnd(2, 1, 32, dtype=torch.float32, seed=6)
    expect = h + x.sum(0, keepdim=True)
    got, total, normed = ops.residual_update(h, x, impl="triton", present=True, out=h)
    assert got.data_ptr() == h.data_ptr() and normed is None
    assert rel_err(h, expect) <= 1e-6 and rel_err(total, x.sum(0)) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,B,O,I", [(8, 1, 96, 64), (2, 3, 50, 200), (1, 4, 33, 576)])
@pytest.mark.parametrize("config", [tk.GEMV_CONFIGS[0], tk.GEMV_CONFIGS[3]])
def test_lane_gemv(dtype, L, B, O, I, config):
    x, w = rnd(L, B, I, dtype=dtype, seed=I), rnd(L, O, I, dtype=dtype, seed=O, scale=I ** -0.5)
    got = ops.lane_gemv(x, w, impl="triton", config=config)
    assert rel_err(got, reference.lane_gemv(x.float(), w.float())) <= TOL[dtype]


def test_lane_gemv_refuses_large_batches():
    with pytest.raises(ValueError, match="batches up to"):
        tk.lane_gemv(torch.zeros(1, 8, 16), torch.zeros(1, 4, 16))


def test_dispatcher_picks_torch_on_cpu_and_checks_impl():
    x = torch.randn(2, 8)
    assert ops.choose(x, None) == "torch"
    with pytest.raises(ValueError, match="impl must be"):
        ops.rms_norm(x, torch.ones(8), 1e-5, impl="cuda")
