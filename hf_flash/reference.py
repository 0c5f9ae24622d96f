"""FlashAttention-2 in plain PyTorch: the CPU path and the kernels' twin in tests.

The algorithm is the kernels' one, written for clarity instead of speed:
tiles of ``BLOCK_N`` keys, an online softmax that keeps the row max ``m`` and
row sum ``l``, an unnormalised output rescaled once at the end, and the
log-sum-exp saved for a backward that recomputes P from it. Math runs in
float32 (float64 for float64 inputs); outputs come back in the input dtype.

Every function takes the arguments of the ``hf_flash::fwd`` / ``hf_flash::bwd``
ops (see ``hf_flash.ops``): dense ``(B, S, H, D)`` tensors, or varlen
``(T, H, D)`` tensors with ``cu_seqlens_*``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

BLOCK_N = 128

_M32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def philox(seed: int, c0, c1, c2, c3):
    """Philox4x32-10 on int64 tensors holding uint32 values; returns 4 words.

    int64 products wrap modulo 2^64, so their low 64 bits are the exact
    unsigned product of two 32-bit values: hi/lo are read off with shifts.
    """
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        p0 = c0 * _PHILOX_M0
        p1 = c2 * _PHILOX_M1
        hi0, lo0 = (p0 >> 32) & _M32, p0 & _M32
        hi1, lo1 = (p1 >> 32) & _M32, p1 & _M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _M32, (k1 + _PHILOX_W1) & _M32
    return c0, c1, c2, c3


def dropout_keep(rng_state, batch: int, num_heads: int, rows, cols, p: float) -> torch.Tensor:
    """Keep-mask (H, len(rows), len(cols)) of one sequence, as the kernels draw it."""
    seed, offset = (int(x) for x in rng_state.tolist())
    seed &= (1 << 64) - 1
    heads = torch.arange(num_heads, dtype=torch.int64, device=rows.device)[:, None, None]
    c0 = (cols[None, None, :] >> 2).expand(num_heads, len(rows), len(cols))
    c1 = rows[None, :, None].expand_as(c0)
    c2 = (batch * num_heads + heads).expand_as(c0)
    c3 = torch.full_like(c0, offset & _M32)
    words = torch.stack(philox(seed, c0, c1, c2, c3), dim=-1)
    word = torch.gather(words, -1, (cols & 3)[None, None, :, None].expand(*c0.shape, 1)).squeeze(-1)
    threshold = min(int(p * 4294967296.0), _M32)
    return word >= threshold


def _visible(rows, cols, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int):
    """(len(rows), len(cols)) bool: key j visible to query i (bottom-right aligned)."""
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    j = cols[None, :]
    ok = j < seqlen_k
    if window_left >= 0:
        ok = ok & (j >= diag - window_left)
    if window_right >= 0:
        ok = ok & (j <= diag + window_right)
    return ok


class _Sequence:
    """One sequence's view of the op arguments: q (H, Sq, D), k/v (Hk, Sk, D)."""

    def __init__(self, q, k, v, batch, seqlen_k, args):
        self.q, self.k, self.v, self.batch = q, k, v, batch
        self.seqlen_q, self.seqlen_k = q.shape[1], seqlen_k
        (self.scale, causal, wl, wr, self.softcap, alibi, self.p_drop, self.rng_state) = args
        self.window_left = wl
        self.window_right = 0 if causal else wr
        self.slopes = None
        if alibi is not None:
            self.slopes = (alibi[batch] if alibi.dim() == 2 else alibi).to(q.dtype)
        self.groups = q.shape[0] // k.shape[0]
        self.rows = torch.arange(self.seqlen_q, device=q.device)

    def kv(self, t, cols):
        """Key/value rows `cols`, repeated over the query heads of each group."""
        return t[:, cols].repeat_interleave(self.groups, dim=0)

    def scores(self, cols):
        """Masked logits (H, Sq, n) in natural-log units, and tanh(.) for softcap's backward."""
        s = torch.einsum("hqd,hkd->hqk", self.q, self.kv(self.k, cols)) * self.scale
        t = None
        if self.softcap > 0:
            t = torch.tanh(s / self.softcap)
            s = self.softcap * t
        if self.slopes is not None:
            dist = (self.rows[:, None] + self.seqlen_k - self.seqlen_q - cols[None, :]).abs()
            s = s - self.slopes[:, None, None] * dist
        mask = _visible(self.rows, cols, self.seqlen_q, self.seqlen_k, self.window_left, self.window_right)
        return s.masked_fill(~mask, -math.inf), t

    def dropout_scale(self, cols):
        """Per-element factor keep / (1 - p), or None without dropout."""
        if self.p_drop <= 0:
            return None
        keep = dropout_keep(self.rng_state, self.batch, self.q.shape[0], self.rows, cols, self.p_drop)
        return keep.to(self.q.dtype) / (1.0 - self.p_drop)

    def blocks(self):
        for start in range(0, self.k.shape[1], BLOCK_N):
            yield torch.arange(start, min(start + BLOCK_N, self.k.shape[1]), device=self.q.device)

    def forward(self):
        h, sq, _ = self.q.shape
        m = torch.full((h, sq), -math.inf, dtype=self.q.dtype, device=self.q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(h, sq, self.v.shape[-1], dtype=self.q.dtype, device=self.q.device)
        for cols in self.blocks():
            s, _ = self.scores(cols)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # fully masked so far: no NaN
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            drop = self.dropout_scale(cols)
            if drop is not None:
                p = p * drop
            acc = alpha[..., None] * acc + torch.einsum("hqk,hkd->hqd", p, self.kv(self.v, cols))
            m = m_new
        empty = l == 0
        out = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None])
        lse = torch.where(empty, math.inf, m + torch.log(torch.where(empty, 1.0, l)))
        return out, lse

    def backward(self, out, dout, lse):
        dq = torch.zeros_like(self.q)
        dk = torch.zeros(self.q.shape[0], *self.k.shape[1:], dtype=self.q.dtype, device=self.q.device)
        dv = torch.zeros_like(dk)
        delta = (dout * out).sum(-1)  # D = rowsum(dO * O)
        for cols in self.blocks():
            s, t = self.scores(cols)
            p = torch.exp(s - lse[..., None])  # lse = +inf on empty rows gives p = 0
            v_blk, k_blk = self.kv(self.v, cols), self.kv(self.k, cols)
            dp = torch.einsum("hqd,hkd->hqk", dout, v_blk)
            drop = self.dropout_scale(cols)
            p_used = p if drop is None else p * drop
            if drop is not None:
                dp = dp * drop
            dv[:, cols] += torch.einsum("hqk,hqd->hkd", p_used, dout)
            ds = p * (dp - delta[..., None])
            if t is not None:
                ds = ds * (1 - t * t)
            ds = ds * self.scale
            dq += torch.einsum("hqk,hkd->hqd", ds, k_blk)
            dk[:, cols] += torch.einsum("hqk,hqd->hkd", ds, self.q)
        hk = self.k.shape[0]
        fold = lambda g: g.view(hk, self.groups, *g.shape[1:]).sum(1)  # GQA: sum over the group
        return dq, fold(dk), fold(dv)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """Yield (batch, q-rows, k-rows, valid keys) per sequence, as slices into the inputs."""
    if cu_seqlens_q is None:
        for b in range(q.shape[0]):
            sk = k.shape[1] if seqused_k is None else int(seqused_k[b])
            yield b, (b, slice(None)), (b, slice(None)), sk
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            sk = ck[b + 1] - ck[b] if seqused_k is None else int(seqused_k[b])
            yield b, (slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),), sk


def _sequence(q, k, v, qi, ki, sk, b, args):
    dt = _compute_dtype(q)
    heads_first = lambda t: t.to(dt).transpose(0, 1)  # (S, H, D) -> (H, S, D)
    kk, vv = heads_first(k[ki]), heads_first(v[ki])
    return _Sequence(heads_first(q[qi]), kk[:, :sk], vv[:, :sk], b, sk, args)


def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state):
    """Forward: returns out (like q) and lse (float32; (B, H, Sq) dense, (H, T) varlen)."""
    args = (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    out = torch.zeros_like(q)
    if cu_seqlens_q is None:
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for b, qi, ki, sk in _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k):
        o_b, lse_b = _sequence(q, k, v, qi, ki, sk, b, args).forward()
        out[qi] = o_b.transpose(0, 1).to(q.dtype)
        if cu_seqlens_q is None:
            lse[b] = lse_b.float()
        else:
            lse[:, qi[0]] = lse_b.float()
    return out, lse


def bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state):
    """Backward by recomputation from the saved LSE: returns dq, dk, dv."""
    args = (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dt = _compute_dtype(q)
    for b, qi, ki, sk in _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, None):
        seq = _sequence(q, k, v, qi, ki, sk, b, args)
        lse_b = (lse[b] if cu_seqlens_q is None else lse[:, qi[0]]).to(dt)
        o_b, do_b = (t[qi].to(dt).transpose(0, 1) for t in (out, dout))
        dq_b, dk_b, dv_b = seq.backward(o_b, do_b, lse_b)
        dq[qi] = dq_b.transpose(0, 1).to(q.dtype)
        dk[ki] = dk_b.transpose(0, 1).to(k.dtype)
        dv[ki] = dv_b.transpose(0, 1).to(v.dtype)
    return dq, dk, dv


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, key_padding_mask=None, dropout_keep_mask=None, dropout_p=0.0):
    """Textbook attention on dense (B, S, H, D) tensors, materialising the full
    score matrix in the inputs' dtype: the test oracle for the tiled reference
    and the kernels. ``key_padding_mask`` (B, Sk) bool marks valid keys;
    ``dropout_keep_mask`` (B, H, Sq, Sk) applies dropout after the softmax."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(sq, device=q.device)
    cols = torch.arange(sk, device=q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None].expand(b, h)
        dist = (rows[:, None] + sk - sq - cols[None, :]).abs()
        s = s - slopes.to(s.dtype)[:, :, None, None] * dist
    wl, wr = window_size
    mask = _visible(rows, cols, sq, sk, wl, 0 if causal else wr)[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    if dropout_keep_mask is not None:
        p = p * dropout_keep_mask.to(p.dtype) / (1 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)
