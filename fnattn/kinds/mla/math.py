"""Multi-head latent attention (MLA, DeepSeek-V2/V3), for one request.

Per token the cache holds one row ``[c_kv, k_pe]`` of width ``Dlat = R + Dr``:
the latent ``c_kv`` (``kv_lora_rank`` R, after ``kv_a_layernorm``) followed by
the shared rope key ``k_pe`` (Dr dims, rope already applied). ``kv_b_proj``
expands the latent per head into a no-rope key (``W_UK``, ``[H, Dn, R]``) and a
value (``W_UV``, ``[H, Dv, R]``). Head ``h`` scores key ``j`` as::

    scale * (q_nope[h] . (W_UK[h] c_j)  +  q_pe[h] . k_pe_j)

and reads ``W_UV[h] c_j``. ``mla_expanded`` materialises the per-head keys and
values; ``mla_absorbed`` moves ``W_UK`` onto the query and ``W_UV`` after the
weighted sum, so it never leaves latent space. Both give the same result.

Keys are ordered cached prefix first, then this step's new tokens. Causal
means new token ``i`` sees every cached token and new tokens ``0..i``
(``docs/layout.md``). ``lse`` is the natural-log log-sum-exp of the scaled
scores over the keys attended, ``-inf`` (with a zero output) when a query sees
no key. Attention math runs in fp32, its softmax in ``fnattn.kernels.attention_naive``
(the one statement of it); ``o`` is returned in ``q_nope.dtype`` and ``lse`` in fp32.

The projections that produce these inputs from a checkpoint's weights are the
model's (``fnattn.models.mla_layer``). Dimension names: T new tokens, N keys
(cached + new), H heads, Dn / Dr / Dv no-rope, rope and value head dims, R
``kv_lora_rank``, Dlat = R + Dr. No input is modified.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kernels.attention_naive import latent_attention_fixed_order, masked_softmax
from fnattn.lanes import in_static_step

__all__ = [
    "topk_mask",
    "AttentionForm",
    "key_visibility",
    "mla_absorbed",
    "mla_attention",
    "mla_expanded",
    "mla_fixed_order",
]

AttentionForm = Literal["absorbed", "expanded"]


def key_visibility(
    n_queries: int, n_keys: int, *, n_cached: int, causal: bool = True, device: torch.device | str | None = None
) -> Bool[Tensor, "T N"]:
    """``visible[i, j]``: may new token ``i`` attend key ``j``?

    Keys are the ``n_cached`` cached tokens followed by the new tokens. With
    ``causal`` every key is visible except new tokens after ``i``; this needs
    ``n_keys == n_cached + n_queries``. Without it every key is visible.
    """
    if not 0 <= n_cached <= n_keys:
        raise ValueError(f"n_cached: expected 0 <= n_cached <= {n_keys} (keys), got {n_cached}")
    if not causal:
        return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    if n_keys != n_cached + n_queries:
        raise ValueError(
            f"n_cached: causal attention expects keys = n_cached + new tokens, "
            f"got {n_keys} keys, n_cached={n_cached}, {n_queries} new tokens"
        )
    query_pos = n_cached + torch.arange(n_queries, device=device)
    key_pos = torch.arange(n_keys, device=device)
    return key_pos[None, :] <= query_pos[:, None]


# --------------------------------------------------------------------------- #
# MLA core: one request, explicit keys
# --------------------------------------------------------------------------- #


def _check_core(
    q_nope: Tensor, q_pe: Tensor, latent: Tensor, w_uk: Tensor, w_uv: Tensor, allowed: Tensor | None
) -> tuple[int, int, int, int]:
    """Validate the core inputs; return ``(T, H, N, R)``."""
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("latent", latent), ("w_uk", w_uk), ("w_uv", w_uv)):
        expect_float(name, x)
    expect_shape("q_nope", q_nope, (None, None, None))
    T, H, Dn = q_nope.shape
    expect_shape("q_pe", q_pe, (T, H, None))
    Dr = q_pe.shape[2]
    expect_shape("w_uk", w_uk, (H, Dn, None))
    R = w_uk.shape[2]
    expect_shape("w_uv", w_uv, (H, None, R))
    expect_shape("latent", latent, (None, R + Dr))
    N = latent.shape[0]
    if allowed is not None:
        expect_shape("allowed", allowed, (T, N))
        if allowed.dtype != torch.bool:
            raise ValueError(f"allowed: expected a bool mask, got dtype {allowed.dtype}")
    return T, H, N, R


def _visible(T: int, N: int, n_cached: int, causal: bool, allowed: Tensor | None, device: torch.device) -> Tensor:
    visible = key_visibility(T, N, n_cached=n_cached, causal=causal, device=device)
    return visible if allowed is None else visible & allowed


def mla_expanded(
    q_nope: Float[Tensor, "T H Dn"],
    q_pe: Float[Tensor, "T H Dr"],
    latent: Float[Tensor, "N Dlat"],
    w_uk: Float[Tensor, "H Dn R"],
    w_uv: Float[Tensor, "H Dv R"],
    *,
    scale: float,
    n_cached: int,
    causal: bool = True,
    allowed: Bool[Tensor, "T N"] | None = None,
) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """MLA with the latent expanded to per-head keys and values.

    ``latent`` rows are ``[c_kv, k_pe]`` for the ``n_cached`` cached tokens then
    the new ones. ``allowed`` (optional) further restricts which keys each query
    may attend (sparse attention). Returns ``(o, lse)``.
    """
    T, H, N, R = _check_core(q_nope, q_pe, latent, w_uk, w_uv, allowed)
    visible = _visible(T, N, n_cached, causal, allowed, q_nope.device)
    f32 = torch.float32
    c_kv, k_pe = latent[:, :R].to(f32), latent[:, R:].to(f32)
    k_nope = torch.einsum("nr,hdr->nhd", c_kv, w_uk.to(f32))
    value = torch.einsum("nr,hvr->nhv", c_kv, w_uv.to(f32))
    scores = torch.einsum("thd,nhd->thn", q_nope.to(f32), k_nope)
    scores = scores + torch.einsum("thd,nd->thn", q_pe.to(f32), k_pe)
    probs, lse = masked_softmax(scores * scale, visible[:, None, :])
    o = torch.einsum("thn,nhv->thv", probs, value)
    return o.to(q_nope.dtype), lse


def mla_absorbed(
    q_nope: Float[Tensor, "T H Dn"],
    q_pe: Float[Tensor, "T H Dr"],
    latent: Float[Tensor, "N Dlat"],
    w_uk: Float[Tensor, "H Dn R"],
    w_uv: Float[Tensor, "H Dv R"],
    *,
    scale: float,
    n_cached: int,
    causal: bool = True,
    allowed: Bool[Tensor, "T N"] | None = None,
) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """MLA in absorbed form: same arguments and result as ``mla_expanded``.

    ``q_nope`` goes through ``W_UK`` into latent space and is scored against
    ``c_kv`` directly; the weighted sum of latents goes through ``W_UV``.
    """
    T, H, N, R = _check_core(q_nope, q_pe, latent, w_uk, w_uv, allowed)
    visible = _visible(T, N, n_cached, causal, allowed, q_nope.device)
    f32 = torch.float32
    c_kv, k_pe = latent[:, :R].to(f32), latent[:, R:].to(f32)
    q_latent = torch.einsum("thd,hdr->thr", q_nope.to(f32), w_uk.to(f32))
    scores = torch.einsum("thr,nr->thn", q_latent, c_kv)
    scores = scores + torch.einsum("thd,nd->thn", q_pe.to(f32), k_pe)
    probs, lse = masked_softmax(scores * scale, visible[:, None, :])
    o_latent = torch.einsum("thn,nr->thr", probs, c_kv)
    o = torch.einsum("thr,hvr->thv", o_latent, w_uv.to(f32))
    return o.to(q_nope.dtype), lse


def mla_fixed_order(
    q_nope: Float[Tensor, "T H Dn"],
    q_pe: Float[Tensor, "T H Dr"],
    latent: Float[Tensor, "N Dlat"],
    w_uk: Float[Tensor, "H Dn R"],
    w_uv: Float[Tensor, "H Dv R"],
    *,
    scale: float,
    n_cached: int,
    causal: bool = True,
    allowed: Bool[Tensor, "T N"] | None = None,
) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """``mla_absorbed``'s arguments and result in the invariant mode (`fnattn.kernels.invariant`).

    Each token reduces in an order fixed by its own context alone
    (`fnattn.kernels.attention_naive.latent_attention_fixed_order`): latent row ``j`` is position ``j``,
    in key tiles fixed by position. With ``allowed`` (sparse attention) a token attends exactly its
    visible allowed rows, gathered in ascending position and tiled as positions ``0..m-1``: its result
    depends on which rows it selected, not on the order of the selection, the request's length or the
    step's other tokens. fp32 math, ``o`` in ``q_nope.dtype``.
    """
    T, H, N, R = _check_core(q_nope, q_pe, latent, w_uk, w_uv, allowed)
    dev = q_nope.device
    visible = _visible(T, N, n_cached, causal, allowed, dev)  # checks n_cached against the keys
    if allowed is None:
        # Non-causal: every key is visible, as to a query at the last key's position.
        q_pos = n_cached + torch.arange(T, device=dev) if causal else torch.full((T,), N - 1, device=dev)
        o, lse = latent_attention_fixed_order(q_nope, q_pe, latent, w_uk, w_uv, q_pos, torch.arange(N, device=dev),
                                              scale=scale)
        return o.to(q_nope.dtype), lse
    outs, lses = [], []
    for t in range(T):
        rows = visible[t].nonzero()[:, 0]  # ascending positions
        m = rows.numel()
        o, lse = latent_attention_fixed_order(q_nope[t:t + 1], q_pe[t:t + 1], latent[rows], w_uk, w_uv,
                                              torch.full((1,), m - 1, device=dev), torch.arange(m, device=dev),
                                              scale=scale)
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs) if outs else q_nope.new_zeros(0, H, w_uv.shape[1], dtype=torch.float32)
    lse = torch.cat(lses) if lses else q_nope.new_zeros(0, H, dtype=torch.float32)
    return o.to(q_nope.dtype), lse


def mla_attention(
    q_nope: Float[Tensor, "T H Dn"],
    q_pe: Float[Tensor, "T H Dr"],
    latent: Float[Tensor, "N Dlat"],
    w_uk: Float[Tensor, "H Dn R"],
    w_uv: Float[Tensor, "H Dv R"],
    *,
    scale: float,
    n_cached: int,
    causal: bool = True,
    allowed: Bool[Tensor, "T N"] | None = None,
    form: AttentionForm = "absorbed",
) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """``mla_absorbed`` or ``mla_expanded``, chosen by ``form``."""
    if form not in ("absorbed", "expanded"):
        raise ValueError(f"form: expected 'absorbed' or 'expanded', got {form!r}")
    core = mla_absorbed if form == "absorbed" else mla_expanded
    return core(q_nope, q_pe, latent, w_uk, w_uv, scale=scale, n_cached=n_cached, causal=causal, allowed=allowed)


def topk_mask(indices: Int[Tensor, "T topk"], *, n_keys: int) -> Bool[Tensor, "T N"]:
    """Bool mask ``[T, n_keys]``, True at the selected key positions (``-1``
    entries select nothing). Pass it as ``allowed`` to the MLA functions."""
    expect_shape("indices", indices, (None, None))
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices: expected an integer tensor, got dtype {indices.dtype}")
    if indices.numel() and not in_static_step() and (int(indices.min()) < -1 or int(indices.max()) >= n_keys):
        raise ValueError(
            f"indices: expected values in [-1, {n_keys}), got [{int(indices.min())}, {int(indices.max())}]"
        )
    T = indices.shape[0]
    slots = torch.where(indices < 0, n_keys, indices).to(torch.int64)  # -1 -> a spare column
    mask = torch.zeros(T, n_keys + 1, dtype=torch.bool, device=indices.device)
    mask = mask.scatter(1, slots, True)
    return mask[:, :n_keys]
