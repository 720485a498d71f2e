"""Triton kernels of the batch-1 decode step, one launcher per kernel (same arguments as `reference`).

Rows are lane-major (`r = lane * B + b`). Every kernel reads and writes contiguous rows, computes in
float32 and rounds where the model rounds. No autotuning: block shapes follow from the tensor shapes
(and, for the lane GEMV, from a config the caller measured), so the same code runs compiled on CUDA
and under `TRITON_INTERPRET=1` on the CPU, where the tests run it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# ---- RMSNorm (replicated or per-lane weight) fused with the cast ------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, rows_per_lane, w_lane_stride, eps, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    o = tl.arange(0, BLOCK_D)
    m = o < D
    x = tl.load(x_ptr + r * D + o, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + (r // rows_per_lane) * w_lane_stride + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * D + o, (y * w).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    R, D = x.shape
    x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(R, D, dtype=out_dtype or x.dtype, device=x.device)
    per_lane = weight.dim() == 2
    rows_per_lane = R // weight.shape[0] if per_lane else R
    _rms_norm_kernel[(R,)](x, weight, y, D, max(1, rows_per_lane), D if per_lane else 0, float(eps),
                           BLOCK_D=_pow2(D), num_warps=4)
    return y


# ---- interleaved RoPE on q and k, fused with the KV-cache write --------------------------------------

@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                    HQ, HKV, HD, HALF, slots, pos_stride, lane_rows, cache_lane_rows, map_ptr,
                    BLOCK_T: tl.constexpr, HAS_MAP: tl.constexpr):
    r = tl.program_id(0)
    if HAS_MAP:  # each row's cache row, given
        cr = tl.load(map_ptr + r)
    else:
        cr = (r // lane_rows) * cache_lane_rows + r % lane_rows  # the row's cache row
    h = tl.program_id(1)  # 0..HQ-1: a query head; HQ..HQ+HKV-1: a key head (and its value head)
    pos = tl.load(pos_ptr + r * pos_stride)  # one position for all rows (stride 0) or one per row
    t = tl.arange(0, BLOCK_T)
    m = t < HALF
    c = tl.load(cos_ptr + pos * HALF + t, mask=m, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + t, mask=m, other=0.0)
    row = qkv_ptr + r * (HQ + 2 * HKV) * HD
    x0 = tl.load(row + h * HD + 2 * t, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(row + h * HD + 2 * t + 1, mask=m, other=0.0).to(tl.float32)
    y0 = (x0 * c - x1 * s).to(q_ptr.dtype.element_ty)
    y1 = (x0 * s + x1 * c).to(q_ptr.dtype.element_ty)
    if h < HQ:
        q_off = (r * HQ + h) * HD
        tl.store(q_ptr + q_off + 2 * t, y0, mask=m)
        tl.store(q_ptr + q_off + 2 * t + 1, y1, mask=m)
    else:
        j = h - HQ
        slot = pos % slots
        c_off = (cr * HKV + j) * slots * HD + slot * HD
        tl.store(kc_ptr + c_off + 2 * t, y0, mask=m)
        tl.store(kc_ptr + c_off + 2 * t + 1, y1, mask=m)
        v_off = r * (HQ + 2 * HKV) * HD + (HQ + HKV + j) * HD
        tl.store(vc_ptr + c_off + 2 * t, tl.load(qkv_ptr + v_off + 2 * t, mask=m, other=0.0), mask=m)
        tl.store(vc_ptr + c_off + 2 * t + 1, tl.load(qkv_ptr + v_off + 2 * t + 1, mask=m, other=0.0), mask=m)


def rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                  num_q_heads: int, num_kv_heads: int, head_dim: int, cache_rows=None) -> Tensor:
    N = qkv.shape[0]
    lane_rows, cache_lane_rows, row_map = _cache_rows(cache_rows, N, k_cache)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    qkv = qkv.contiguous()
    q = torch.empty(N, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    _rope_kv_kernel[(N, num_q_heads + num_kv_heads)](
        qkv, cos, sin, pos, q, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, half, k_cache.shape[2],
        _pos_stride(pos, N), lane_rows, cache_lane_rows, pos if row_map is None else row_map, BLOCK_T=_pow2(half),
        HAS_MAP=row_map is not None, num_warps=1)
    return q


# ---- decode attention: flash-decoding over the static cache, then a log-sum-exp merge ----------------

@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr,
                       HQ, HKV, HD, REP, slots, window, split_len, n_splits, scale, pos_stride,
                       lane_rows, cache_lane_rows, map_ptr,
                       BLOCK_R: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_S: tl.constexpr,
                       CHECK_WINDOW: tl.constexpr, IEEE: tl.constexpr, FUSED_ROPE: tl.constexpr,
                       HAS_MAP: tl.constexpr):
    """One split of one (row, KV head)'s slots. FUSED_ROPE: q_ptr is the un-rotated qkv row; the program
    rotates its query heads, and the one program whose split holds this position's slot rotates the new
    key, writes key and value into that slot and uses them from registers (no other program reads it)."""
    pid = tl.program_id(0)  # (row, kv head)
    sp = tl.program_id(1)  # which split of the slots
    r = pid // HKV
    g = pid % HKV
    if HAS_MAP:  # each row's cache row, given
        cr = tl.load(map_ptr + r)
    else:
        cr = (r // lane_rows) * cache_lane_rows + r % lane_rows  # the row's cache row
    pos = tl.load(pos_ptr + r * pos_stride).to(tl.int32)
    start = sp * split_len
    # slots past pos were never written; the last split that holds a written slot does the work
    end = tl.minimum(start + split_len, tl.minimum(slots, pos + 1))
    rr = tl.arange(0, BLOCK_R)  # the GQA group's query heads, padded to the matrix unit's 16 rows
    rm = rr < REP
    d = tl.arange(0, BLOCK_HD)
    dm = d < HD
    qh = r * HQ + g * REP + rr
    qm = rm[:, None] & dm[None, :]
    if FUSED_ROPE:  # interleaved pairs: y[2t] = x[2t] c - x[2t+1] s, y[2t+1] = x[2t] s + x[2t+1] c
        row = q_ptr + r * (HQ + 2 * HKV) * HD
        half = HD // 2
        c = tl.load(cos_ptr + pos * half + d // 2, mask=dm, other=0.0)
        sn = tl.load(sin_ptr + pos * half + d // 2, mask=dm, other=0.0)
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
        hoff = (g * REP + rr) * HD
        x = tl.load(row + hoff[:, None] + d[None, :], mask=qm, other=0.0).to(tl.float32)
        xp = tl.load(row + hoff[:, None] + (d ^ 1)[None, :], mask=qm, other=0.0).to(tl.float32)
        q = (x * c[None, :] + sign[None, :] * xp * sn[None, :]).to(kc_ptr.dtype.element_ty)
        kx = tl.load(row + (HQ + g) * HD + d, mask=dm, other=0.0).to(tl.float32)
        kxp = tl.load(row + (HQ + g) * HD + (d ^ 1), mask=dm, other=0.0).to(tl.float32)
        k_new = (kx * c + sign * kxp * sn).to(kc_ptr.dtype.element_ty)
        v_new = tl.load(row + (HQ + HKV + g) * HD + d, mask=dm, other=0.0)
        slot_now = pos % slots
        if (slot_now >= start) & (slot_now < start + split_len):
            dst = (cr * HKV + g) * slots * HD + slot_now * HD + d
            tl.store(kc_ptr + dst, k_new, mask=dm)
            tl.store(vc_ptr + dst, v_new.to(vc_ptr.dtype.element_ty), mask=dm)
    else:
        q = tl.load(q_ptr + qh[:, None] * HD + d[None, :], mask=qm, other=0.0)
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_HD], dtype=tl.float32)
    base = (cr * HKV + g) * slots * HD
    for off in range(start, end, BLOCK_S):
        j = off + tl.arange(0, BLOCK_S)
        vis = j < end
        if CHECK_WINDOW:  # a ring larger than the window: slot j holds position j + k * slots
            held = j + ((pos - j) // slots) * slots
            vis = vis & (held > pos - window)
        kv_mask = vis[:, None] & dm[None, :]
        k = tl.load(kc_ptr + base + j[:, None] * HD + d[None, :], mask=kv_mask, other=0.0)
        if FUSED_ROPE:
            k = tl.where((j == slot_now)[:, None], k_new[None, :], k)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_R, BLOCK_S]
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(vis[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        v = tl.load(vc_ptr + base + j[:, None] * HD + d[None, :], mask=kv_mask, other=0.0)
        if FUSED_ROPE:
            v = tl.where((j == slot_now)[:, None], v_new[None, :].to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_off = (qh * n_splits + sp) * HD
    tl.store(o_ptr + o_off[:, None] + d[None, :], out, mask=rm[:, None] & dm[None, :])
    tl.store(lse_ptr + qh * n_splits + sp, lse, mask=rm)


@triton.jit
def _attn_merge_kernel(o_ptr, lse_ptr, out_ptr, pos_ptr, HD, slots, split_len, n_splits, HQ, pos_stride,
                       BLOCK_SP: tl.constexpr, BLOCK_HD: tl.constexpr):
    """Merge one query head's split results by their log-sum-exps, over the splits that hold written
    slots only (so the cost follows the position, not the cache's capacity), BLOCK_SP splits at a time."""
    qh = tl.program_id(0)  # one query head of one row
    pos = tl.load(pos_ptr + (qh // HQ) * pos_stride).to(tl.int32)
    used = tl.minimum((tl.minimum(slots, pos + 1) + split_len - 1) // split_len, n_splits)
    d = tl.arange(0, BLOCK_HD)
    dm = d < HD
    top = tl.zeros([BLOCK_HD], dtype=tl.float32) - float("inf")  # running max (kept per lane of d)
    total = tl.zeros([BLOCK_HD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HD], dtype=tl.float32)
    for s0 in range(0, used, BLOCK_SP):
        s = s0 + tl.arange(0, BLOCK_SP)
        sm = s < used
        lse = tl.load(lse_ptr + qh * n_splits + s, mask=sm, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, axis=0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        w = tl.where((lse > float("-inf"))[:, None], tl.exp(lse[:, None] - safe[None, :]), 0.0)  # [BLOCK_SP, BLOCK_HD]
        o = tl.load(o_ptr + (qh * n_splits + s)[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        scale = tl.exp(top - safe)
        acc = acc * scale + tl.sum(o * w, axis=0)
        total = total * scale + tl.sum(w, axis=0)
        top = new_top
    tl.store(out_ptr + qh * HD + d, (acc / total).to(out_ptr.dtype.element_ty), mask=dm)


def _cache_rows(cache_rows, rows: int, k_cache: Tensor) -> tuple[int, int, Tensor | None]:
    """(rows per lane, cache rows per lane, None): row r = lane * b + i reads and writes cache row
    lane * c + i (a pool of c rows per lane whose first b are in use); None: row r is cache row r. A
    tensor: each row's cache row (1, 1, the tensor)."""
    if isinstance(cache_rows, Tensor):
        if cache_rows.numel() != rows or not cache_rows.is_contiguous() or cache_rows.is_floating_point():
            raise ValueError(f"a cache row per row: {rows} integers, contiguous; got {list(cache_rows.shape)}")
        return 1, 1, cache_rows
    if cache_rows is None:
        if k_cache.shape[0] != rows:
            raise ValueError(f"a cache of {k_cache.shape[0]} rows for {rows} rows needs cache_rows")
        return rows, rows, None
    b, c = cache_rows
    if rows % b or k_cache.shape[0] != rows // b * c or b > c:
        raise ValueError(f"cache_rows {cache_rows} do not fit {rows} rows and a cache of {k_cache.shape[0]}")
    return b, c, None


def _pos_stride(pos: Tensor, rows: int) -> int:
    """The position tensor's stride over rows: 0 for one position shared by every row, 1 for one per row."""
    if pos.numel() == 1:
        return 0
    if pos.numel() != rows or not pos.is_contiguous():
        raise ValueError(f"positions: one, or one per row ({rows}), contiguous; got {list(pos.shape)}")
    return 1


FULL_WINDOW = 1 << 30  # a full-attention layer: every written slot is within this window


def attention_splits(slots: int, split_len: int | None = None) -> tuple[int, int]:
    """(split length, number of splits) for a cache of `slots` slots: splits of 64 slots by default, so each
    program walks at most two blocks of keys and a batch-1 step at a few hundred positions still spreads
    over ~100 programs (splits past the position return at once)."""
    split_len = max(16, min(_pow2(slots), split_len or 64))
    return split_len, triton.cdiv(slots, split_len)


ATTENTION_CONFIGS = ((32, 32, 4), (64, 32, 4), (64, 64, 4), (32, 16, 2), (128, 64, 4), (16, 16, 2))
"""(split length, keys per block, warps) candidates; the CUDA step measures them on its own caches."""


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, window: int | None,
                     config: tuple[int, int, int] | None = None, cache_rows=None) -> Tensor:
    return _attention(q, k_cache, v_cache, pos, window, config, rope=None, cache_rows=cache_rows)


def rope_attention(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                   num_q_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                   config: tuple[int, int, int] | None = None, cache_rows=None) -> Tensor:
    """`rope_kv_write` then `decode_attention` in one kernel (plus the merge): qkv [N, (Hq + 2 Hkv) hd].
    With a cache row per row (a tensor `cache_rows`) rows may share a cache row (a verify's positions),
    and one row reads what another writes: then the two kernels, one after the other."""
    if isinstance(cache_rows, Tensor):
        q = rope_kv_write(qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, cache_rows)
        return decode_attention(q, k_cache, v_cache, pos, window, config, cache_rows)
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim and k_cache.shape[1] == num_kv_heads
    assert cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    return _attention(qkv.contiguous(), k_cache, v_cache, pos, window, config, rope=(cos, sin, num_q_heads),
                      cache_rows=cache_rows)


def _attention(q, k_cache, v_cache, pos, window, config, rope, cache_rows=None):
    N = q.shape[0]
    lane_rows, cache_lane_rows, row_map = _cache_rows(cache_rows, N, k_cache)
    hkv, slots, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = rope[2] if rope else q.shape[1]
    rep = hq // hkv
    q = q.contiguous()
    split_len, block_s, warps = config or (None, 32, 4)
    split, n_splits = attention_splits(slots, split_len)
    o_part = torch.empty(N * hq, n_splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(N * hq, n_splits, dtype=torch.float32, device=q.device)
    window = int(window or FULL_WINDOW)
    cos, sin = (rope[0], rope[1]) if rope else (o_part, o_part)
    _attn_split_kernel[(N * hkv, n_splits)](
        q, k_cache, v_cache, pos, o_part, lse, cos, sin, hq, hkv, hd, rep, slots, window, split, n_splits,
        hd ** -0.5, _pos_stride(pos, N), lane_rows, cache_lane_rows, pos if row_map is None else row_map, BLOCK_R=max(16, _pow2(rep)), BLOCK_HD=max(16, _pow2(hd)), BLOCK_S=max(16, min(split, block_s)),
        CHECK_WINDOW=window < slots, IEEE=k_cache.dtype == torch.float32, FUSED_ROPE=rope is not None,
        HAS_MAP=row_map is not None, num_warps=warps)
    out = torch.empty(N, hq, hd, dtype=k_cache.dtype, device=q.device)
    _attn_merge_kernel[(N * hq,)](o_part, lse, out, pos, hd, slots, split, n_splits, hq, _pos_stride(pos, N),
                                  BLOCK_SP=min(16, _pow2(n_splits)), BLOCK_HD=_pow2(hd), num_warps=2)
    return out


# ---- SwiGLU --------------------------------------------------------------------------------------

@triton.jit
def _swiglu_kernel(gu_ptr, y_ptr, F, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < F
    g = tl.load(gu_ptr + r * 2 * F + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * F + F + o, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + r * F + o, (s * u).to(y_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: Tensor) -> Tensor:
    R, F2 = gate_up.shape
    F = F2 // 2
    gate_up = gate_up.contiguous()
    y = torch.empty(R, F, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(F))
    _swiglu_kernel[(R, triton.cdiv(F, block))](gate_up, y, F, BLOCK=block, num_warps=4)
    return y


# ---- the delayed residual update for all lanes, with the next norm --------------------------------------

@triton.jit
def _residual_kernel(h_ptr, x_ptr, told_ptr, past_ptr, sum_ptr, nw_ptr, normed_ptr,
                     B, D, scale, eps, nw_lane_stride, L: tl.constexpr,
                     PRESENT: tl.constexpr, HAS_PAST: tl.constexpr, SCALED: tl.constexpr,
                     WANT_SUM: tl.constexpr, NORM: tl.constexpr, EXT_TOTAL: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    lane = tl.program_id(1)
    o = tl.arange(0, BLOCK_D)
    m = o < D
    dt = h_ptr.dtype.element_ty
    row = (lane * B + b) * D
    x = tl.load(x_ptr + row + o, mask=m, other=0.0).to(tl.float32)
    if EXT_TOTAL:  # PRESENT with the sum over every rank's lanes given (told_ptr)
        s = tl.load(told_ptr + b * D + o, mask=m, other=0.0).to(tl.float32)
    elif PRESENT or WANT_SUM:
        s = tl.zeros([BLOCK_D], dtype=tl.float32)
        for ll in tl.static_range(L):  # every program sums the lanes itself (no cross-program dependency)
            s += tl.load(x_ptr + (ll * B + b) * D + o, mask=m, other=0.0).to(tl.float32)
        s = s.to(dt).to(tl.float32)
        if WANT_SUM:
            if lane == 0:
                tl.store(sum_ptr + b * D + o, s.to(dt), mask=m)
    if PRESENT:
        add = s
    elif HAS_PAST:
        t = tl.load(told_ptr + b * D + o, mask=m, other=0.0).to(tl.float32)
        p = tl.load(past_ptr + row + o, mask=m, other=0.0).to(tl.float32)
        add = (x + (t - p).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    elif SCALED:
        add = (x * scale).to(dt).to(tl.float32)
    else:
        add = x
    h = (tl.load(h_ptr + row + o, mask=m, other=0.0).to(tl.float32) + add).to(dt)
    tl.store(h_ptr + row + o, h, mask=m)
    if NORM:
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        y = (hf * rstd).to(dt).to(tl.float32)
        w = tl.load(nw_ptr + lane * nw_lane_stride + o, mask=m, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row + o, (y * w).to(normed_ptr.dtype.element_ty), mask=m)


def residual_update(h: Tensor, x: Tensor, *, present: bool = False, scale: float = 1.0,
                    total_old: Tensor | None = None, past: Tensor | None = None, want_sum: bool = False,
                    norm_weight: Tensor | None = None, eps: float = 1e-5,
                    norm_dtype: torch.dtype | None = None, out: Tensor | None = None, total: Tensor | None = None):
    """As `reference.residual_update`; updates `out` (default: a copy of h) in place and returns it."""
    L, B, D = h.shape
    if out is None:
        out = h.clone()
    elif out.data_ptr() != h.data_ptr():
        out.copy_(h)
    assert out.is_contiguous()
    x = x.contiguous()
    has_past = total_old is not None and not present
    ext_total = present and total is not None
    if ext_total:
        total_old, want_sum = total.contiguous(), False
    else:
        total = torch.empty(B, D, dtype=h.dtype, device=h.device) if (present or want_sum) else None
    normed = None
    if norm_weight is not None:
        normed = torch.empty(L, B, D, dtype=norm_dtype or h.dtype, device=h.device)
        norm_weight = norm_weight.contiguous()
    dummy = out
    _residual_kernel[(B, L)](
        out, x, total_old.contiguous() if (has_past or ext_total) else dummy, past.contiguous() if has_past else dummy,
        total if (total is not None and not ext_total) else dummy, norm_weight if norm_weight is not None else dummy,
        normed if normed is not None else dummy, B, D, float(scale), float(eps),
        D if (norm_weight is not None and norm_weight.dim() == 2) else 0, L=L,
        PRESENT=bool(present), HAS_PAST=has_past, SCALED=scale != 1.0, WANT_SUM=total is not None and not ext_total,
        NORM=norm_weight is not None, EXT_TOTAL=ext_total, BLOCK_D=_pow2(D), num_warps=4)
    return out, total, normed


# ---- lane-batched GEMV (batch-1 projections) -----------------------------------------------------------

@triton.jit
def _lane_gemv_kernel(x_ptr, w_ptr, y_ptr, B, O, I,
                      BLOCK_B: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    lane = tl.program_id(0)
    oo = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    om = oo < O
    bb = tl.arange(0, BLOCK_B)
    bm = bb < B
    acc = tl.zeros([BLOCK_B, BLOCK_O], dtype=tl.float32)
    w_base = w_ptr + lane * O * I
    x_base = x_ptr + lane * B * I
    for i0 in range(0, I, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        im = ii < I
        w = tl.load(w_base + oo[:, None] * I + ii[None, :], mask=om[:, None] & im[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_base + bb[:, None] * I + ii[None, :], mask=bm[:, None] & im[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    y_off = (lane * B + bb)[:, None] * O + oo[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=bm[:, None] & om[None, :])


@triton.jit
def _lane_gemv1_kernel(x_ptr, w_ptr, y_ptr, O, I, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    """Batch 1: each program streams BLOCK_O rows of one lane's weight, multiply-accumulating elementwise
    into a [BLOCK_O, BLOCK_I] tile and reducing once at the end."""
    lane = tl.program_id(0)
    oo = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    om = oo < O
    acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    w_base = w_ptr + lane.to(tl.int64) * O * I
    for i0 in range(0, I, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        im = ii < I
        x = tl.load(x_ptr + lane * I + ii, mask=im, other=0.0).to(tl.float32)
        w = tl.load(w_base + oo[:, None] * I + ii[None, :], mask=om[:, None] & im[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + lane * O + oo, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=om)


GEMV_CONFIGS = ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (8, 1024, 8), (16, 256, 4), (32, 256, 8))
"""(BLOCK_O, BLOCK_I, warps) candidates; the CUDA step measures them per weight shape against cuBLAS."""
GEMV_MAX_BATCH = 4


def lane_gemv(x: Tensor, w: Tensor, config: tuple[int, int, int] = (8, 512, 4)) -> Tensor:
    L, B, I = x.shape
    O = w.shape[1]
    if B > GEMV_MAX_BATCH:
        raise ValueError(f"the lane GEMV serves batches up to {GEMV_MAX_BATCH}, got {B}")
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(L, B, O, dtype=x.dtype, device=x.device)
    block_o, block_i, warps = config
    block_i = min(block_i, max(16, _pow2(I)))
    if B == 1:
        _lane_gemv1_kernel[(L, triton.cdiv(O, block_o))](x, w, y, O, I, BLOCK_O=block_o, BLOCK_I=block_i,
                                                          num_warps=warps)
    else:
        _lane_gemv_kernel[(L, triton.cdiv(O, block_o))](x, w, y, B, O, I, BLOCK_B=_pow2(B), BLOCK_O=block_o,
                                                         BLOCK_I=block_i, num_warps=warps)
    return y

