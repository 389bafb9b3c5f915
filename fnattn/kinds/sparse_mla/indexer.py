"""The DSA lightning indexer's selection (DeepSeek-V3.2, GLM-5), for one request.

The indexer keeps one small key per token (``[N, Di]``, cached next to the MLA
latent) and, for every new token, scores all visible tokens::

    score[t, j] = sum_h w[t, h] * relu(softmax_scale * q[t, h] . k[j])

with ``softmax_scale = Di ** -0.5`` by default. Each new token then attends
(MLA, ``fnattn.kinds.mla.math``) only the ``topk`` best-scoring visible tokens, passed
as the ``allowed`` mask. Visibility is causal and includes the token itself:
new token ``i`` may select any cached token and new tokens ``0..i``.

The indexer queries, head weights and keys come from a checkpoint's weights in
the model (``fnattn.models.dsa_layer``). Dimension names: Hi indexer heads, Di
indexer head dim, topk selected tokens per query; others as in
``fnattn.kinds.mla.math``. No input is modified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kernels.attention_naive import KEY_TILE, QUERY_ROWS
from fnattn.kernels.indexer import ordered_topk

from ..mla.math import key_visibility, topk_mask

__all__ = ["indexer_scores", "indexer_scores_fixed_order", "topk_indices", "topk_mask"]


def _checked_scores_args(q_idx, w, keys, softmax_scale):
    """The score functions' argument checks: ``-> (T, Hi, Di, softmax_scale or its default Di ** -0.5)``."""
    for name, x in (("q_idx", q_idx), ("w", w), ("keys", keys)):
        expect_float(name, x)
    expect_shape("q_idx", q_idx, (None, None, None))
    T, Hi, Di = q_idx.shape
    expect_shape("w", w, (T, Hi))
    expect_shape("keys", keys, (None, Di))
    return T, Hi, Di, Di**-0.5 if softmax_scale is None else softmax_scale


def indexer_scores(
    q_idx: Float[Tensor, "T Hi Di"],
    w: Float[Tensor, "T Hi"],
    keys: Float[Tensor, "N Di"],
    *,
    softmax_scale: float | None = None,
) -> Float[Tensor, "T N"]:
    """``score[t, j] = sum_h w[t, h] * relu(softmax_scale * q_idx[t, h] . keys[j])``
    in fp32, for every key (no causal mask here). ``softmax_scale`` defaults
    to ``Di ** -0.5``."""
    *_, softmax_scale = _checked_scores_args(q_idx, w, keys, softmax_scale)
    f32 = torch.float32
    per_head = F.relu(torch.einsum("thd,nd->thn", q_idx.to(f32), keys.to(f32)) * softmax_scale)
    return torch.einsum("th,thn->tn", w.to(f32), per_head)


def indexer_scores_fixed_order(
    q_idx: Float[Tensor, "T Hi Di"],
    w: Float[Tensor, "T Hi"],
    keys: Float[Tensor, "N Di"],
    *,
    softmax_scale: float | None = None,
) -> Float[Tensor, "T N"]:
    """`indexer_scores` in the invariant mode (`fnattn.kernels.invariant`): the same scores, each computed on
    fixed shapes (blocks of ``QUERY_ROWS`` tokens, padded, against tiles of ``KEY_TILE`` keys, padded), so a
    token's score of a key is the same bits in a prefill, a verify or a decode step. The product of a step's
    queries with its keys is a matmul whose reduction order follows the step's size, and a score's last bit
    moves the top-k's boundary."""
    T, Hi, Di, softmax_scale = _checked_scores_args(q_idx, w, keys, softmax_scale)
    N, dev, f32 = keys.shape[0], keys.device, torch.float32
    tiles = -(-N // KEY_TILE)
    kt = torch.zeros(tiles * KEY_TILE, Di, device=dev)
    kt[:N] = keys.to(f32)
    kt = kt.view(tiles, KEY_TILE, Di)
    scores = torch.zeros(-(-T // QUERY_ROWS) * QUERY_ROWS, tiles * KEY_TILE, device=dev)
    for r0 in range(0, T, QUERY_ROWS):
        m = min(QUERY_ROWS, T - r0)
        qb = torch.zeros(QUERY_ROWS, Hi, Di, device=dev)
        qb[:m] = q_idx[r0:r0 + m].to(f32)
        wb = torch.zeros(QUERY_ROWS, Hi, device=dev)
        wb[:m] = w[r0:r0 + m].to(f32)
        for c in range(tiles):
            per_head = F.relu((qb[:, :, None, :] * kt[c][None, None]).sum(-1) * softmax_scale)  # [rows, Hi, tile]
            scores[r0:r0 + QUERY_ROWS, c * KEY_TILE:(c + 1) * KEY_TILE] = (wb[:, :, None] * per_head).sum(1)
    return scores[:T, :N]


def topk_indices(scores: Float[Tensor, "T N"], *, n_cached: int, topk: int) -> Int[Tensor, "T topk"]:
    """The ``topk`` best visible keys of each new token, best first, as int64
    key positions; ``-1`` fills the row when fewer than ``topk`` keys are
    visible (then every visible key is selected).

    Keys are the ``n_cached`` cached tokens then the ``T`` new ones (``N =
    n_cached + T``); new token ``i`` sees the cached tokens and new tokens
    ``0..i``. Equal scores go to the earlier position
    (`fnattn.kernels.indexer.ordered_topk`), so a token selects the same keys
    whatever follows it in its prompt, the chunking and the phase.
    ``transformers`` leaves ties to ``torch.topk``, whose choice among equal
    scores follows the row's length: the two agree wherever the scores at the
    top-k boundary are distinct.
    """
    expect_float("scores", scores)
    expect_shape("scores", scores, (None, None))
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected a positive int, got {topk!r}")
    T, N = scores.shape
    visible = key_visibility(T, N, n_cached=n_cached, device=scores.device)
    masked = scores.masked_fill(~visible, float("-inf"))
    picked = ordered_topk(masked, min(topk, N))
    picked = torch.where(visible.gather(1, picked), picked, torch.full_like(picked, -1))
    if picked.shape[1] < topk:
        picked = F.pad(picked, (0, topk - picked.shape[1]), value=-1)
    return picked.to(torch.int64)


