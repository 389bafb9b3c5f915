"""Latent-space pieces the fast MLA backends share: absorbing ``W_UK`` into the query, attending the
step's own rows (which are not in the cache during the step), merging two partial attentions by
log-sum-exp and expanding the latent output through ``W_UV``.

All of it is device work on the batch's tensors with shapes fixed by the batch, so a decode step
that uses it can be captured in a CUDA graph. Dimension names as in `fnattn.kinds.mla.math`;
Dq = R + Dr (the absorbed query / cached row width), B requests, n new tokens per request.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ...checks import fail
from ...kernels.attention_naive import masked_softmax, merge_states
from ...switches import declare, switched

LN2 = math.log(2.0)


# mla_absorb_sweep.json (c32b134, H200, 128 heads): the query in one launch 11.8 / 12.9 / 13.8 / 16.8 / 21.2 us
# against 14.5 / 15.8 / 16.6 / 18.3 / 21.3 for the batched product and copy at 1 / 8 / 32 / 64 / 128 tokens: on.
_ABSORB_KERNEL = declare(
    "absorb_kernel", True, __name__,
    on="a decode-sized absorbed MLA query on the GPU ([q_nope W_UK, q_pe]) takes one launch "
       "(`fnattn.kernels.absorb_query`)",
    off="a batched product and a copy of q_pe (`absorbed_query_torch`)",
    why="with 128 heads on the H200 the query took 11.8 / 13.8 / 21.2 us against 14.5 / 16.6 / 21.3 at 1 / 32 "
        "/ 128 tokens; the torch form is what an engine's MLA layer runs")
# mla_absorb_sweep_e322246.json: the own-row merge with W_UV in one launch (the merged latent through one product,
# 16 tokens a program) 13.8 / 14.4 / 16.6 / 21.4 / 28.3 us against 14.8 / 15.4 / 18.5 / 23.0 / 30.8 for the merge
# kernel and the batched product at 1 / 8 / 32 / 64 / 128 tokens; in the dense FlashMLA layer (mla_merge_layers.json,
# 9a881b6) 58.9 against 62.2 us at B8 ctx 4k, 152.4 against 154.3 at B64: on.
_MERGE_VALUES = declare(
    "merge_values_kernel", True, __name__,
    on="a dense MLA decode token's own-row merge and W_UV take one launch "
       "(`fnattn.kernels.latent_absorb.merge_own_values`)",
    off="the merge kernel and a batched product",
    why="the dense FlashMLA layer on the H200 took 58.9 against 62.2 us at B8 ctx 4k, 152.4 against 154.3 at B64")
ABSORB_KERNEL_MAX_TOKENS = 256  # beyond decode / verify sizes the product is compute-bound: cuBLAS's


def absorb_kernel(enabled: bool):
    """Within this block a decode-sized absorbed query on the GPU (up to ``ABSORB_KERNEL_MAX_TOKENS`` tokens)
    takes one launch (`fnattn.kernels.absorb_query`, the default) or a batched product and a copy of ``q_pe``
    (`absorbed_query_torch`)."""
    return switched(_ABSORB_KERNEL, "absorb_kernel", enabled)


def merge_values_kernel(enabled: bool):
    """Within this block one decode token per request of a dense MLA layer on the GPU has its own-row merge and
    ``W_UV`` in one launch (`fnattn.kernels.latent_absorb.merge_own_values`, the default) or the merge kernel and
    a batched product. Sparse MLA has its own switch (`fnattn.kinds.sparse_mla.flashmla.merge_values_kernel`)."""
    return switched(_MERGE_VALUES, "merge_values_kernel", enabled)


def absorbed_query(inputs) -> Float[Tensor, "T H Dq"]:
    """``[q_nope W_UK, q_pe]`` per head in the layer dtype: what a latent-space kernel scores.

    A decode-sized query on the GPU takes one launch (`fnattn.kernels.absorb_query`) unless within
    ``absorb_kernel(False)``; otherwise `absorbed_query_torch`.
    """
    q_nope = inputs.q_nope
    if (_ABSORB_KERNEL[-1] and q_nope.is_cuda and q_nope.shape[0] <= ABSORB_KERNEL_MAX_TOKENS
            and q_nope.dtype == inputs.q_pe.dtype == inputs.w_uk.dtype):
        from ...kernels.latent_absorb import absorb_query

        return absorb_query(q_nope, inputs.q_pe, inputs.w_uk)
    return absorbed_query_torch(inputs)


def absorbed_query_torch(inputs) -> Float[Tensor, "T H Dq"]:
    """`absorbed_query` in torch ops: what an engine's MLA layer runs around its kernel.

    The batched product writes straight into its columns of the result (per head, rows of the result's
    stride, which cuBLAS takes as they are) and ``q_pe`` is copied beside it: no ``[T, H, R]``
    intermediate read back through a transpose to be concatenated (at batch 64, 128 heads the
    concatenation took 21 us of a 174 us layer on the H200).
    """
    q_nope, q_pe, w_uk = inputs.q_nope, inputs.q_pe, inputs.w_uk  # [T, H, Dn], [T, H, Dr], [H, Dn, R]
    T, H, R = q_nope.shape[0], q_nope.shape[1], w_uk.shape[2]
    q = torch.empty((T, H, R + q_pe.shape[2]), dtype=torch.result_type(q_nope, q_pe), device=q_nope.device)
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q.transpose(0, 1)[..., :R])  # [H, T, R] into q[:, :, :R]
    q[..., R:] = q_pe
    return q


def fold_own_rows_out(q: Float[Tensor, "T H Dq"], o_c: Float[Tensor, "T H R"], lse_c: Float[Tensor, "T H"],
                      new: Float[Tensor, "T Dq"], w_uv: Float[Tensor, "H Dv R"], *, n: int, scale: float,
                      lse_base2: bool = False, allowed: Bool[Tensor, "T n"] | None = None,
                      cache_lens: Tensor | None = None, one_launch: bool | None = None
                      ) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """`fold_own_rows` then `values_out`: ``(o, natural-log lse)``. With ``one_launch`` (``None``: as
    `merge_values_kernel` says) one decode token per request on the GPU takes one launch for both
    (`fnattn.kernels.latent_absorb.merge_own_values`)."""
    one_launch = _MERGE_VALUES[-1] if one_launch is None else one_launch
    if (one_launch and n == 1 and q.is_cuda and q.shape[0] <= ABSORB_KERNEL_MAX_TOKENS
            and o_c.dtype == w_uv.dtype == new.dtype):
        from ...kernels.latent_absorb import merge_own_values

        return merge_own_values(o_c, lse_c, q, new, w_uv, scale=scale, lse_base2=lse_base2, cache_lens=cache_lens,
                                allowed=None if allowed is None else allowed[:, 0])
    o_lat, lse = fold_own_rows(q, o_c, lse_c, new, n=n, scale=scale, lse_base2=lse_base2, allowed=allowed,
                               cache_lens=cache_lens)
    return values_out(o_lat, w_uv), lse


def values_out(o_lat: Float[Tensor, "T H R"], w_uv: Float[Tensor, "H Dv R"]) -> Float[Tensor, "T H Dv"]:
    """The latent weighted sum through ``W_UV``, in the layer dtype."""
    return torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def uniform_new(batch, where: str) -> int:
    """New tokens per request of a decode / verify batch (1 + draft tokens, the same for every row)."""
    n = batch.num_draft + 1
    if any(m != n for m in batch.host_new_lens):
        fail(where, "batch", f"{n} new tokens per request (a decode / verify batch)", batch.host_new_lens)
    return n


def own_rows(q: Float[Tensor, "T H Dq"], new: Float[Tensor, "T Dq"], *, n: int, scale: float, R: int,
             allowed: Bool[Tensor, "T n"] | None = None) -> tuple[Float[Tensor, "T H R"], Float[Tensor, "T H"]]:
    """Each token over its request's new rows up to itself (``allowed`` narrows them further), fp32.

    Requests hold ``n`` consecutive tokens each. Returns the latent output and natural-log LSE,
    ``-inf`` (with a zero output) for a token that attends none of them.
    """
    T, H, D = q.shape
    B = T // n
    qb, kb = q.view(B, n, H, D).float(), new.view(B, n, D).float()
    s = torch.einsum("bihd,bjd->bihj", qb, kb) * scale  # [B, n, H, n]
    vis = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None]  # [1, i, j]
    if allowed is not None:
        vis = vis & allowed.view(B, n, n)
    p, lse = masked_softmax(s, vis[:, :, None, :])  # [B, n, H, n], [B, n, H]
    o = torch.einsum("bihj,bjr->bihr", p, kb[..., :R])
    return o.reshape(T, H, R), lse.reshape(T, H)


def merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two attentions over disjoint key sets as one, fp32 (natural-log LSEs; ``-inf`` marks an empty part,
    whose output is ignored): `fnattn.kernels.attention_naive.merge_states`."""
    return merge_states(o1, lse1, o2, lse2)


def no_keys_as_neg_inf(lse: Tensor, has_keys: Tensor | None = None) -> Tensor:
    """Kernels mark a query with no key by ``lse = +inf`` (FlashMLA, with a zero output) or leave it
    undefined; make it ``-inf``, as the references do. ``has_keys [T, 1]`` marks rows known empty."""
    empty = torch.isposinf(lse) | torch.isnan(lse)
    if has_keys is not None:
        empty = empty | ~has_keys
    return lse.masked_fill(empty, float("-inf"))


def fold_own_rows(q: Float[Tensor, "T H Dq"], o_c: Float[Tensor, "T H R"], lse_c: Float[Tensor, "T H"],
                  new: Float[Tensor, "T Dq"], *, n: int, scale: float, lse_base2: bool = False,
                  allowed: Bool[Tensor, "T n"] | None = None,
                  cache_lens: Tensor | None = None) -> tuple[Float[Tensor, "T H R"], Float[Tensor, "T H"]]:
    """The cached part merged with each token's own new rows (causal; ``allowed`` narrows them, for
    sparse layers): ``(o_lat, natural-log lse)``.

    One decode token per request takes the fused Triton kernel on the GPU (its own score, a kernel's no-key
    marks in ``lse_c`` (+inf / NaN), ``allowed`` and the merge in one launch, ``fnattn.kernels.merge_new_token``);
    1 + k verify tokens the torch path, which reads the same marks. A marked query's cached output must be
    zero (FlashMLA's); with ``cache_lens`` [B] a request with an empty cache attended no cached key either,
    whatever its output holds.
    """
    R = o_c.shape[-1]
    if n == 1 and q.is_cuda and importlib.util.find_spec("triton") is not None:
        from ...kernels import merge_new_token

        # a token whose own row is not among its top-k (``allowed`` False) keeps the cached part alone
        return merge_new_token(o_c, lse_c, q, new[:, None], new[:, None, :R], scale=scale, lse_base2=lse_base2,
                               cache_lens=cache_lens, allowed=None if allowed is None else allowed[:, 0])
    has_keys = None if cache_lens is None else (cache_lens > 0).repeat_interleave(n)[:, None]  # [T, 1]
    if has_keys is not None:
        o_c = torch.where(has_keys[..., None], o_c, 0.0)
    lse_c = no_keys_as_neg_inf(lse_c * LN2 if lse_base2 else lse_c, has_keys)
    o_n, lse_n = own_rows(q, new, n=n, scale=scale, R=R, allowed=allowed)
    return merge(o_c, lse_c, o_n, lse_n)
