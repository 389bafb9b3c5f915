"""The one pure-torch statement of softmax attention and of the merge of its partial results, in fp32.

These are the references of the attention kernels beside them (`paged_attention`'s `attend_ref` and
`paged_*_ref`, `lse_merge`'s `*_ref`) and the arithmetic of the references of `fnattn.kinds.full`
(`.math`) and `fnattn.kinds.mla` (the masked softmax of `.math`, the merge of `.latent`). Plain tensors
in and out; nothing here checks shapes (the callers do) and no input is modified or returned as an
alias. The semantics are docs/layout.md's:

    visible_keys    which keys each query sees: causal by absolute position, optionally a sliding window
    masked_softmax  a softmax over the visible keys, with its natural-log log-sum-exp
    attention       dense grouped-query attention (softcap, window, sinks) -> (o, lse)
    attention_fixed_order
                    the same attention, each query reduced in an order that depends only on its position
                    and its keys (the invariant mode, `fnattn.kernels.invariant`)
    apply_sinks     one value-less logit per head joins a finished softmax's denominator
    merge_states    attention over two disjoint key sets -> attention over their union

A query that sees no key attends nothing: its output is 0 and its lse -inf. An lse never includes the
sinks, so that partial results still merge; the sinks are applied once, to the merged result.
"""

import torch


def visible_keys(q_pos, k_pos, *, sliding_window=0):
    """``visible [n, m]``: query at position ``q_pos[i]`` sees the key at ``k_pos[j]`` iff
    ``k_pos[j] <= q_pos[i]`` and, with a window W > 0, ``q_pos[i] - k_pos[j] < W``."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window > 0:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return visible


def masked_softmax(scores, visible):
    """Softmax over the last dim of ``scores`` where ``visible`` (a bool mask broadcasting against them):
    ``-> (probs like scores, lse = scores.shape[:-1])``, the lse in natural log. A row with no visible
    key gets zero probs and lse -inf."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # An empty row's lse is -inf: subtracting 0 instead keeps its exp at exp(-inf) = 0, not NaN.
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite_lse[..., None]), lse


def apply_sinks(o, lse, sinks):
    """``o [..., H, Dv]`` of a softmax whose natural-log ``lse [..., H]`` leaves the sinks out, with one
    more logit per head ``sinks [H]`` (and no value) in its denominator: ``o * sigmoid(lse - sink)``."""
    return o * torch.sigmoid(lse - sinks.float())[..., None]


def attention(q, k, v, q_pos, k_pos, *, scale, softcap=0.0, sliding_window=0, sinks=None):
    """Dense masked attention over explicit positions, fp32.

    ``q [n, Hq, D]``, ``k [m, Hkv, D]``, ``v [m, Hkv, Dv]`` (query head h reads kv head ``h // (Hq // Hkv)``),
    ``q_pos [n]``, ``k_pos [m]`` (`visible_keys`). Scores are ``scale * q . k``, then
    ``softcap * tanh(s / softcap)`` where ``softcap > 0``. ``sinks [Hq]`` (optional) join the denominator.
    Returns ``o [n, Hq, Dv]`` and ``lse [n, Hq]`` (without the sinks), both fp32.
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [m, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)  # [m, Hq, Dv]
    s = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale  # [Hq, n, m]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p, lse = masked_softmax(s, visible_keys(q_pos, k_pos, sliding_window=sliding_window)[None])
    o = torch.einsum("hnm,mhd->nhd", p, vf)
    lse = lse.transpose(0, 1).contiguous()  # [n, Hq]
    return (o, lse) if sinks is None else (apply_sinks(o, lse, sinks), lse)


def merge_states(o1, lse1, o2, lse2):
    """Two attentions over disjoint key sets as one, fp32: ``o1, o2 [..., Dv]``, natural-log ``lse1, lse2 [...]``
    ``-> (o, lse)`` with ``lse = logaddexp(lse1, lse2)`` and ``o = o1 exp(lse1 - lse) + o2 exp(lse2 - lse)``.

    A part with lse -inf attended nothing and its o is ignored (it may hold anything, NaN included); with
    both parts empty the result is ``o = 0``, ``lse = -inf``.
    """
    lse = torch.logaddexp(lse1, lse2)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1 = torch.exp(lse1 - finite_lse)[..., None]
    w2 = torch.exp(lse2 - finite_lse)[..., None]
    o = torch.where(w1 > 0, o1.float(), 0.0) * w1 + torch.where(w2 > 0, o2.float(), 0.0) * w2
    return o, lse


KEY_TILE = 16  # keys of positions [c * KEY_TILE, (c + 1) * KEY_TILE) form tile c
QUERY_ROWS = 8  # queries are reduced in blocks of this many rows, padded
HEAD_ALIGN = 8  # heads padded to a multiple of this: a block's [QUERY_ROWS, heads] is whole 64-float blocks


def attention_fixed_order(q, k, v, q_pos, k_pos, *, scale, softcap=0.0, sliding_window=0, sinks=None,
                          key_tile=KEY_TILE, query_rows=QUERY_ROWS):
    """`attention` with each query's reduction order fixed by positions alone, fp32.

    ``k_pos`` are distinct non-negative positions. Tile c holds the keys of positions ``[c * key_tile,
    (c + 1) * key_tile)`` in a zero-filled buffer of ``key_tile`` rows (a position without a key is
    masked); each tile's softmax is merged into the running result in tile order; queries go through in
    blocks of ``query_rows`` rows (padded). Every product and sum then runs on the same shapes whoever
    else is in the step, so a query's ``(o, lse)`` is the same bits whether it is computed in a prefill of
    many tokens, in a verify of a few or alone in a decode step, and whichever keys past its own position
    are present (masked keys weigh exactly 0; wholly masked tiles merge as no-ops). Torch's reductions
    choose their order by the shapes they see (one product of a step's size reduces a row differently as
    the step grows), which is why nothing here is sized by the step. Its CPU loops also round exp and log
    differently in a vector body and in the scalar tail after it, so the heads are padded (zeros, cut off
    at the end) to a multiple of `HEAD_ALIGN`: every per-block tensor is then whole vector blocks, and a
    query's ``lse`` does not follow the slot of the block it sits in. ``sinks`` join per block, for the same
    reason.
    """
    n, Hq, D = q.shape
    Dv, group = v.shape[-1], Hq // k.shape[1]
    Hp = -(-Hq // HEAD_ALIGN) * HEAD_ALIGN
    dev = q.device
    tiles = int(k_pos.max()) // key_tile + 1 if k_pos.numel() else 0
    kt = torch.zeros(tiles * key_tile, Hp, D, device=dev)
    vt = torch.zeros(tiles * key_tile, Hp, Dv, device=dev)
    present = torch.zeros(tiles * key_tile, dtype=torch.bool, device=dev)
    rows = k_pos.long()
    kt[rows, :Hq] = k.float().repeat_interleave(group, dim=1)
    vt[rows, :Hq] = v.float().repeat_interleave(group, dim=1)
    present[rows] = True
    kt = kt.view(tiles, key_tile, Hp, D).transpose(1, 2).contiguous()  # [tiles, Hp, tile, D]
    vt = vt.view(tiles, key_tile, Hp, Dv).transpose(1, 2).contiguous()  # [tiles, Hp, tile, Dv]
    sinks_p = None
    if sinks is not None:
        sinks_p = torch.zeros(Hp, device=dev)
        sinks_p[:Hq] = sinks.float()
    present = present.view(tiles, key_tile)
    tile_pos = torch.arange(tiles * key_tile, device=dev).view(tiles, key_tile)
    outs, lses = [], []
    for r0 in range(0, n, query_rows):
        m = min(query_rows, n - r0)
        qb = torch.zeros(query_rows, Hp, D, device=dev)
        qb[:m, :Hq] = q[r0:r0 + m].float()
        pb = torch.full((query_rows,), -1, dtype=q_pos.dtype, device=dev)  # a pad row sees no key
        pb[:m] = q_pos[r0:r0 + m]
        o = torch.zeros(query_rows, Hp, Dv, device=dev)
        lse = torch.full((query_rows, Hp), float("-inf"), device=dev)
        for c in range(tiles):
            s = (qb[:, :, None, :] * kt[c][None]).sum(-1) * scale  # [rows, Hp, tile]
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            visible = visible_keys(pb, tile_pos[c], sliding_window=sliding_window) & present[c][None]
            p, tile_lse = masked_softmax(s, visible[:, None, :])
            o, lse = merge_states(o, lse, (p[..., None] * vt[c][None]).sum(-2), tile_lse)
        if sinks_p is not None:
            o = apply_sinks(o, lse, sinks_p)
        outs.append(o[:m, :Hq])
        lses.append(lse[:m, :Hq])
    o = torch.cat(outs) if outs else torch.zeros(0, Hq, Dv, device=dev)
    lse = torch.cat(lses) if lses else torch.zeros(0, Hq, device=dev)
    return o, lse


def latent_attention_fixed_order(q_nope, q_pe, latent, w_uk, w_uv, q_pos, k_pos, *, scale, key_tile=KEY_TILE,
                                 query_rows=QUERY_ROWS):
    """MLA's absorbed form in `attention_fixed_order`'s order, fp32: the invariant mode's latent attention.

    ``q_nope [n, H, Dn]``, ``q_pe [n, H, Dr]`` over ``latent [m, R + Dr]`` (rows ``[c_kv, k_pe]``), with
    ``w_uk [H, Dn, R]``, ``w_uv [H, Dv, R]`` and positions as `attention_fixed_order`'s. Queries go through in
    blocks of ``query_rows`` rows (padded): a block is absorbed (``[q_nope W_UK, q_pe]``), attends the latent
    rows as one key head shared by every query head (K = the row, V = its ``c_kv``) through
    `attention_fixed_order`, and leaves through ``W_UV``. Both projections are elementwise products summed over
    their last dim on the block's fixed shapes: a matmul sized by the step would choose a row's reduction order
    by the step's size. Returns ``o [n, H, Dv]`` and ``lse [n, H]``, fp32.
    """
    n, H, Dn = q_nope.shape
    Dr, R, Dv = q_pe.shape[-1], w_uk.shape[2], w_uv.shape[1]
    dev = q_nope.device
    w_uk_rows = w_uk.float().transpose(1, 2).contiguous()  # [H, R, Dn]: a latent column's weights along Dn
    w_uv_rows = w_uv.float().contiguous()  # [H, Dv, R]
    keys = latent.float()[:, None]  # [m, 1, R + Dr]
    values = keys[..., :R].contiguous()  # [m, 1, R]
    outs, lses = [], []
    for r0 in range(0, n, query_rows):
        m = min(query_rows, n - r0)
        qn = torch.zeros(query_rows, H, Dn, device=dev)
        qn[:m] = q_nope[r0:r0 + m].float()
        qp = torch.zeros(query_rows, H, Dr, device=dev)
        qp[:m] = q_pe[r0:r0 + m].float()
        pb = torch.full((query_rows,), -1, dtype=q_pos.dtype, device=dev)  # a pad row sees no key
        pb[:m] = q_pos[r0:r0 + m]
        q = torch.cat([(qn[:, :, None, :] * w_uk_rows[None]).sum(-1), qp], dim=-1)  # [rows, H, R + Dr]
        o_lat, lse = attention_fixed_order(q, keys, values, pb, k_pos, scale=scale, key_tile=key_tile,
                                           query_rows=query_rows)
        o = (o_lat[:, :, None, :] * w_uv_rows[None]).sum(-1)  # [rows, H, Dv]
        outs.append(o[:m])
        lses.append(lse[:m])
    o = torch.cat(outs) if outs else torch.zeros(0, H, Dv, device=dev)
    lse = torch.cat(lses) if lses else torch.zeros(0, H, device=dev)
    return o, lse
