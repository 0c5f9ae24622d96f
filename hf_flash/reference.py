"""FlashAttention-2 in plain PyTorch: the CPU path and the kernels' twin in tests.

The algorithm is the kernels' one, written for clarity instead of speed:
tiles of ``BLOCK_N`` keys, an online softmax that keeps the row max ``m`` and
row sum ``l``, an unnormalised output rescaled once at the end, and the
log-sum-exp saved for a backward that recomputes P from it. Math runs in
float32 (float64 for float64 inputs); outputs come back in the input dtype.

``fwd``, ``bwd`` and ``fwd_kvcache`` take the arguments of the ``hf_flash::fwd`` / ``bwd`` / ``fwd_kvcache``
ops (schemas in ``csrc/binding.cpp``): dense ``(B, S, H, D)`` tensors, or varlen ``(T, H, D)`` tensors with
``cu_seqlens_*``.
"""

from __future__ import annotations

import math

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
    """Keep-mask (H, len(rows), len(cols)) of one sequence, as the kernels draw it (csrc/tile.cuh dropout_bits):
    element (i, j) takes 16 bits, half (j >> 3) & 1 of word (i >> 3) & 3 of the Philox block at counter
    ((j >> 4) * 8 + (j & 7), (i >> 5) * 8 + (i & 7), batch * H + head, offset), kept iff they are
    >= min(p * 2^16, 2^16 - 1)."""
    seed, offset = (int(x) for x in rng_state.tolist())
    seed &= (1 << 64) - 1
    heads = torch.arange(num_heads, dtype=torch.int64, device=rows.device)[:, None, None]
    c0 = ((cols >> 4) * 8 + (cols & 7))[None, None, :].expand(num_heads, len(rows), len(cols))
    c1 = ((rows >> 5) * 8 + (rows & 7))[None, :, None].expand_as(c0)
    c2 = (batch * num_heads + heads).expand_as(c0)
    c3 = torch.full_like(c0, offset & _M32)
    words = torch.stack(philox(seed, c0, c1, c2, c3), dim=-1)
    word = torch.gather(words, -1, ((rows >> 3) & 3)[None, :, None, None].expand(*c0.shape, 1)).squeeze(-1)
    bits = (word >> (16 * ((cols >> 3) & 1))[None, None, :]) & 0xFFFF
    threshold = min(int(p * 65536.0), 0xFFFF)
    return bits >= threshold


def relative_positions(rows, cols, seqlen_q, seqlen_k, radius: int):
    """Column of ``rel_bias`` for query ``rows`` x key ``cols``: ``clamp(j - i - (seqlen_k - seqlen_q), -R, R) + R``,
    the key's position relative to the query with the masks' bottom-right alignment (query i sits at position
    ``i + seqlen_k - seqlen_q`` among the keys), clamped to the table's radius R: the rule of ``RelBias`` in
    csrc/flash.h. Lengths are ints, or (B,) tensors giving a (B, 1, len(rows), len(cols)) index."""
    if isinstance(seqlen_q, torch.Tensor):
        seqlen_q, seqlen_k = seqlen_q[:, None, None, None], seqlen_k[:, None, None, None]
    return (cols[None, :] - rows[:, None] - (seqlen_k - seqlen_q)).clamp(-radius, radius) + radius


def rel_bias_terms(rel_bias, index):
    """``rel_bias`` (H, 2R+1) gathered at ``index`` ((B, 1, Sq, Sk) or (Sq, Sk)): (B, H, Sq, Sk) or (1, H, Sq, Sk)."""
    if index.dim() == 2:
        return rel_bias[:, index][None]
    return rel_bias[:, index[:, 0]].transpose(0, 1)


def _visible(rows, cols, seqlen_q, seqlen_k, window_left: int, window_right: int):
    """Bool mask, key j visible to query i (bottom-right aligned): the rule of csrc/flash.h, which the
    kernels take from fwd::KeyWindow (csrc/attn/fwd_math.cuh). Lengths are ints, or (B,) tensors giving
    a (B, 1, len(rows), len(cols)) mask."""
    if isinstance(seqlen_q, torch.Tensor):
        seqlen_q, seqlen_k = seqlen_q[:, None, None, None], seqlen_k[:, None, None, None]
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    j = cols[None, :]
    ok = j < seqlen_k
    if window_left >= 0:
        ok = ok & (j >= diag - window_left)
    if window_right >= 0:
        ok = ok & (j <= diag + window_right)
    return ok


class _Batch:
    """The op arguments of a dense batch: q (B, H, Sq, D), k/v (B, Hk, Sk, D), with the keys each row may see
    in len_k (B,) (a KV cache's valid rows; len_q the query count). ``first`` is the batch index of row 0 (a
    varlen sequence run on its own keeps its index in the dropout mask)."""

    def __init__(self, q, k, v, len_q, len_k, args, rel_bias=None, first: int = 0):
        self.q, self.k, self.v, self.len_q, self.len_k, self.first = q, k, v, len_q, len_k, first
        (self.scale, causal, self.window_left, wr, self.softcap, alibi, self.p_drop, self.rng_state) = args
        self.rel_bias = None if rel_bias is None else rel_bias.to(q.dtype)
        self.window_right = 0 if causal else wr
        self.slopes = None
        if alibi is not None:
            b, h = q.shape[:2]
            self.slopes = (alibi if alibi.dim() == 2 else alibi[None].expand(b, h)).to(q.dtype)
        self.groups = q.shape[1] // k.shape[1]
        self.rows = torch.arange(q.shape[2], device=q.device)

    def kv(self, t, cols):
        """Key/value rows `cols`, repeated over the query heads of each group."""
        return t[:, :, cols].repeat_interleave(self.groups, dim=1)

    def scores(self, cols):
        """Masked logits (B, H, Sq, n) in natural-log units, and tanh(.) for softcap's backward."""
        s = torch.einsum("bhqd,bhkd->bhqk", self.q, self.kv(self.k, cols)) * self.scale
        t = None
        if self.softcap > 0:
            t = torch.tanh(s / self.softcap)
            s = self.softcap * t
        if self.slopes is not None:
            offset = (self.len_k - self.len_q)[:, None, None, None]
            dist = (self.rows[:, None] + offset - cols[None, :]).abs()
            s = s - self.slopes[:, :, None, None] * dist
        if self.rel_bias is not None:
            s = s + rel_bias_terms(self.rel_bias, self.rel_index(cols))
        mask = _visible(self.rows, cols, self.len_q, self.len_k, self.window_left, self.window_right)
        return s.masked_fill(~mask, -math.inf), t

    def rel_index(self, cols):
        return relative_positions(self.rows, cols, self.len_q, self.len_k, (self.rel_bias.shape[-1] - 1) // 2)

    def dropout_scale(self, cols):
        """Per-element factor keep / (1 - p), or None without dropout."""
        if self.p_drop <= 0:
            return None
        h = self.q.shape[1]
        keep = torch.stack([dropout_keep(self.rng_state, self.first + b, h, self.rows, cols, self.p_drop)
                            for b in range(self.q.shape[0])])
        return keep.to(self.q.dtype) / (1.0 - self.p_drop)

    def blocks(self):
        for start in range(0, self.k.shape[2], BLOCK_N):
            yield torch.arange(start, min(start + BLOCK_N, self.k.shape[2]), device=self.q.device)

    def forward(self):
        m = torch.full(self.q.shape[:3], -math.inf, dtype=self.q.dtype, device=self.q.device)
        l = torch.zeros_like(m)
        acc = self.q * 0  # not zeros_like: with no key at all the output must still be in the autograd graph
        for cols in self.blocks():
            s, _ = self.scores(cols)
            m_new = torch.maximum(m, s.amax(-1).detach())  # a stabiliser: out and lse do not depend on it
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # fully masked so far: no NaN
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(-1)
            drop = self.dropout_scale(cols)
            if drop is not None:
                p = p * drop
            acc = alpha[..., None] * acc + torch.einsum("bhqk,bhkd->bhqd", p, self.kv(self.v, cols))
            m = m_new
        empty = l == 0
        out = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None])
        lse = torch.where(empty, math.inf, m + torch.log(torch.where(empty, 1.0, l)))
        return out, lse

    def backward(self, out, dout, lse):
        dq = torch.zeros_like(self.q)
        drel = None if self.rel_bias is None else torch.zeros_like(self.rel_bias)
        dk = torch.zeros(*self.q.shape[:2], *self.k.shape[2:], dtype=self.q.dtype, device=self.q.device)
        dv = torch.zeros_like(dk)
        delta = (dout * out).sum(-1)  # D = rowsum(dO * O)
        for cols in self.blocks():
            s, t = self.scores(cols)
            p = torch.exp(s - lse[..., None])  # lse = +inf on empty rows gives p = 0
            v_blk, k_blk = self.kv(self.v, cols), self.kv(self.k, cols)
            dp = torch.einsum("bhqd,bhkd->bhqk", dout, v_blk)
            drop = self.dropout_scale(cols)
            p_used = p if drop is None else p * drop
            if drop is not None:
                dp = dp * drop
            dv[:, :, cols] += torch.einsum("bhqk,bhqd->bhkd", p_used, dout)
            ds = p * (dp - delta[..., None])
            if t is not None:
                ds = ds * (1 - t * t)
            if drel is not None:  # d logit, summed per table column over every (query, key) that reads it
                heads = torch.arange(ds.shape[1], device=ds.device)[None, :, None, None].expand_as(ds)
                drel.index_put_((heads, self.rel_index(cols).expand_as(ds)), ds, accumulate=True)
            ds = ds * self.scale
            dq += torch.einsum("bhqk,bhkd->bhqd", ds, k_blk)
            dk[:, :, cols] += torch.einsum("bhqk,bhqd->bhkd", ds, self.q)
        b, hk = self.k.shape[:2]
        fold = lambda g: g.view(b, hk, self.groups, *g.shape[2:]).sum(2)  # GQA: sum over the group
        return dq, fold(dk), fold(dv), drel


def _math_layout(x, dtype):
    """(B, S, H, D) in the op layout -> (B, H, S, D) in the math dtype."""
    return x.to(dtype).transpose(1, 2)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """Row slices (queries, keys) of each varlen sequence. The varlen reference runs the sequences one at a
    time: padding them to the longest would cost B * max Sq * max Sk, up to hundreds of times the work."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _sequence_args(args, i: int):
    """The op arguments of varlen sequence i: its row of per-sequence ALiBi slopes (B, H)."""
    alibi = args[5]
    if alibi is not None and alibi.dim() == 2:
        return (*args[:5], alibi[i : i + 1], *args[6:])
    return args


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, seqused_k, args, rel_bias=None, first: int = 0):
    """Dense (B, S, H, D) inputs as a _Batch (``first``: the batch index of row 0, see _Batch)."""
    dt = _compute_dtype(q)
    len_q = torch.full((q.shape[0],), q.shape[1], device=q.device)
    len_k = torch.full((q.shape[0],), k.shape[1], device=q.device) if seqused_k is None else seqused_k.long()
    return _Batch(_math_layout(q, dt), _math_layout(k, dt), _math_layout(v, dt), len_q, len_k, args, rel_bias, first)


def sink_rescale(lse, sinks, head_dim: int):
    """Learned attention sinks (gpt-oss ``s_aux``: one logit per head that joins each row's softmax denominator
    and adds no value), applied to a finished attention result: returns ``(L, factor)`` with
    ``L = logaddexp(lse, sink)`` the row's new log-sum-exp and ``factor = exp(lse - L)`` what its output is
    multiplied by. A row with no visible key (lse = +inf) gets ``L = sink`` and factor 0. ``sinks`` (H,) is
    broadcast along ``head_dim`` of ``lse``; math in lse's dtype. Differentiable (the reference path); the kernels
    apply the same rule in their epilogues (``fwd::row_norm``) and return d sink from the backward's prologue."""
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    sink = sinks.to(lse.dtype).view(shape)
    visible = torch.where(lse == math.inf, -math.inf, lse)
    total = torch.logaddexp(visible, sink)
    return total, torch.exp(visible - total)


def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
        window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic=False, *, seqused_k=None,
        sinks=None, rel_bias=None):
    """Forward: returns out (like q) and lse (float32; (B, H, Sq) dense, (H, T) varlen). Differentiable by
    autograd (the dropout mask is a function of rng_state, so the backward sees the forward's). ``seqused_k``
    (B,): valid keys per row of a KV cache (fwd_kvcache). ``sinks`` (H,): learned attention sinks
    (``sink_rescale``); the LSE returned then includes them. ``rel_bias`` (H, 2R+1): a relative position bias
    added to the scaled logits (``relative_positions`` says which column), with a gradient."""
    args = (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    if cu_seqlens_q is not None:  # (T, H, D) -> out (T, H, D), lse (H, T), one sequence at a time
        outs, lses = [q[:0] * 0], [q.new_empty(q.shape[1], 0, dtype=torch.float32)]
        for i, (rq, rk) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
            o, l = _fwd_dense(q[None, rq], k[None, rk], v[None, rk], _sequence_args(args, i), None, sinks,
                              rel_bias, i)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, 1)
    return _fwd_dense(q, k, v, args, seqused_k, sinks, rel_bias, 0)


def _fwd_dense(q, k, v, args, seqused_k, sinks, rel_bias, first: int):
    """fwd of dense (B, S, H, D) inputs; ``first``: the batch index of row 0 (a varlen sequence's own)."""
    batch = _prepare(q, k, v, seqused_k, args, rel_bias, first)
    out, lse = batch.forward()
    if sinks is not None:
        lse, factor = sink_rescale(lse, sinks, 1)
        out = out * factor[..., None]
    if q.numel() == 0:  # no rows to write: keep the empty output in the autograd graph, as the kernels do
        return q * 0, lse.float().contiguous()
    return torch.empty_like(q).copy_(out.transpose(1, 2)), lse.float().contiguous()  # q's strides, as the fake op


def fwd_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal, window_left, window_right,
                softcap, alibi_slopes, num_splits, sinks=None, rel_bias=None):
    """Forward against a KV cache: row b's keys are cache rows [cache_leftpad[b], cache_seqlens[b]), masks
    aligned to that row's key count. ``num_splits`` only steers the CUDA kernel."""
    end = cache_seqlens.long()
    start = torch.zeros_like(end) if cache_leftpad is None else cache_leftpad.long()
    if not q.is_cuda and not torch.compiler.is_compiling():  # a static cache may be far longer than its valid rows
        k_cache, v_cache = k_cache[:, :int(end.max())], v_cache[:, :int(end.max())]
    if cache_leftpad is not None:  # shift row b left by its leftpad, so its keys start at 0
        pos = (start[:, None] + torch.arange(k_cache.shape[1], device=q.device)).clamp(max=k_cache.shape[1] - 1)
        index = pos[:, :, None, None].expand(-1, -1, *k_cache.shape[2:])
        k_cache, v_cache = k_cache.gather(1, index), v_cache.gather(1, index)
    return fwd(q, k_cache, v_cache, None, None, q.shape[1], k_cache.shape[1], softmax_scale, causal, window_left,
               window_right, softcap, alibi_slopes, 0.0, None, seqused_k=(end - start).clamp(min=0), sinks=sinks,
               rel_bias=rel_bias)


def bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic=False, *,
        rel_bias=None):
    """Backward by recomputation from the saved LSE, as the kernels do it: returns dq, dk, dv, plus d rel_bias
    (the table's dtype) when ``rel_bias`` is given. The kernels' twin in tests; the reference path itself
    differentiates fwd with autograd."""
    args = (softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    if cu_seqlens_q is not None:  # one sequence at a time, its rows written into the (T, H, D) gradients
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        drel = None if rel_bias is None else torch.zeros_like(rel_bias)
        for i, (rq, rk) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
            g = _bwd_dense(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq],
                           _sequence_args(args, i), rel_bias, i)
            dq[rq], dk[rk], dv[rk] = g[0][0], g[1][0], g[2][0]
            if drel is not None:
                drel += g[3]
        return (dq, dk, dv) if rel_bias is None else (dq, dk, dv, drel)
    return _bwd_dense(dout, q, k, v, out, lse, args, rel_bias, 0)


def _bwd_dense(dout, q, k, v, out, lse, args, rel_bias, first: int):
    """bwd of dense (B, S, H, D) inputs; ``first`` as in _fwd_dense."""
    batch = _prepare(q, k, v, None, args, rel_bias, first)
    dq, dk, dv, drel = batch.backward(_math_layout(out, batch.q.dtype), _math_layout(dout, batch.q.dtype),
                                      lse.to(batch.q.dtype))
    grads = tuple(torch.empty_like(t).copy_(g.transpose(1, 2)) for t, g in zip((q, k, v), (dq, dk, dv)))
    return grads if rel_bias is None else (*grads, drel.to(rel_bias.dtype))


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, key_padding_mask=None, dropout_keep_mask=None, dropout_p=0.0, sinks=None,
                    rel_bias=None, return_lse=False):
    """Textbook attention on dense (B, S, H, D) tensors, materialising the full
    score matrix in the inputs' dtype: the test oracle for the tiled reference
    and the kernels. ``key_padding_mask`` (B, Sk) bool marks valid keys;
    ``dropout_keep_mask`` (B, H, Sq, Sk) applies dropout after the softmax;
    ``sinks`` (H,) is an extra logit column per head, in the softmax and dropped after it; ``rel_bias`` (H, 2R+1)
    adds ``rel_bias[h, relative_positions(i, j)]`` to each scaled logit. ``return_lse``
    also returns the natural-log LSE (B, H, Sq), kept finite on rows with no visible key so autograd can
    run through it."""
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
    if rel_bias is not None:
        s = s + rel_bias_terms(rel_bias.to(s.dtype), relative_positions(rows, cols, sq, sk, (rel_bias.shape[-1] - 1) // 2))
    wl, wr = window_size
    mask = _visible(rows, cols, sq, sk, wl, 0 if causal else wr)[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    s = s.masked_fill(~mask, -math.inf)
    empty = ~mask.any(-1, keepdim=True)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    if sinks is not None:
        p = p[..., :-1]
    if dropout_keep_mask is not None:
        p = p * dropout_keep_mask.to(p.dtype) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return (out, torch.logsumexp(s.masked_fill(empty, 0.0), -1)) if return_lse else out
