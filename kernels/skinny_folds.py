"""`skinny_linear` with the op after it in the same launch: a decode step's GEMV and its epilogue (Triton).

Each function is one launch of `skinny_linear._skinny_gemv_kernel` that also writes what the next small
op would, with that op's roundings; when the launch cannot (a split-K projection with more column tiles
than `_counters.COUNTERS`, an empty K), the product and the op run apart, with the same result.

- `skinny_linear_swiglu`: a SwiGLU MLP's gate and up projection and ``silu(gate) * up``. The weight stays
  ``[gate; up]``: a column tile reads gate and up rows of the same pairs, alternating, so each tile has
  what its activation needs and no tile waits for another.
- `skinny_linear_gating`: GDN's input projection, and g and beta from its b and a columns, written by
  the tile that holds them.
- `skinny_linear_add_`: an output projection added into the residual stream in place, with the unfused ops'
  roundings, and the next RMSNorm's two halves that need no whole row: each column tile's sums of squares
  of the new rows, and the rows times the norm's ``offset + weight``. The GEMV after it streams those rows
  into its dots as loaded and scales each row of its product by the rms (`skinny_linear`'s ``rms=``, also
  taken by `skinny_linear_swiglu` and `skinny_linear_gating`). The add + norm launch between the two is gone,
  and nothing waits on an arrival counter for it (a form whose last column tile normalized the whole rows
  itself lost in a whole Qwen3.5-0.8B graph step on the H200: 1.16x the step at eight rows).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ._checks import check_finite_float, check_like, shares_storage
from .gdn_gate import gdn_gating
from .norm_act import silu_and_mul_ref
from .skinny_checks import _check, _check_operand
from .skinny_linear import SkinnyConfig, _launch, column_tiles, skinny_linear


def skinny_linear_swiglu(x: Float[Tensor, "M K"], w: Float[Tensor, "I2 K"], *, rms=None,
                         config: SkinnyConfig | None = None) -> Float[Tensor, "M I"]:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``w = [gate; up]`` (``[2I, K]``, contiguous): ``-> [M, I]`` in
    ``x.dtype``, rounded as `silu_and_mul` of `skinny_linear`'s product. One launch: each column tile
    computes ``block_n / 2`` gate and up products of the same columns and writes their activation.
    ``rms``: the products' rows scaled before the activation, as `skinny_linear`'s.
    ``config``: for the ``[M, K] @ [2I, K]^T`` product (`pick_config`'s by default)."""
    _check(x, w, None, None, config, None, None, rms)
    M, N = x.shape[0], w.shape[0]
    if N % 2:
        raise ValueError(f"w: expected an even number of rows (gate rows, then as many up rows), got {N}")
    y = torch.empty((M, N // 2), dtype=x.dtype, device=x.device)
    if not _launch(x, w, y, None, None, None, config, swiglu=True, rms=rms) and M and N:
        product = skinny_linear(x, w, rms=rms, config=config)
        y.copy_(silu_and_mul_ref(product))  # the activation apart
    return y


def skinny_linear_add_(x: Float[Tensor, "M K"], w: Float[Tensor, "N K"], residual: Float[Tensor, "M N"],
                       weight: Float[Tensor, " N"], offset: float = 0.0, *, config: SkinnyConfig | None = None
                       ) -> tuple[Float[Tensor, "M N"], Float[Tensor, "M N"], Float[Tensor, "M P"]]:
    """``residual += x @ w.T`` in place, rounded as the unfused ops (the product rounded to ``x.dtype``,
    then the sum), and what the next ``rms_norm(residual, weight, offset=offset)`` needs of it without whole
    rows: ``-> (residual, scaled, squares)``; ``scaled = residual * (offset + weight)`` rounded to x's dtype
    (``[M, N]``, new), ``squares`` fp32 ``[M, P]``, one column per column tile of the launch (their row sums
    are the rows' sums of squares). `skinny_linear(scaled, w2, rms=(squares, eps))` is then the product of the
    norm. ``residual``: ``[M, N]`` in x's dtype (rows may be strided), apart from ``x``. Where the launch
    cannot (a split-K projection with more column tiles than the counters, an empty K), the product and the
    add run apart and ``P`` is 1."""
    _check(x, w, None, None, config, residual)
    if residual is None:
        raise ValueError("residual: expected an [M, N] tensor (the residual stream the product joins), got None")
    if shares_storage(residual, x):
        raise ValueError("residual: expected a buffer apart from x's, got one sharing x's storage")
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    _check_operand("weight", weight, (N,), x, row_strided=False)
    check_finite_float("offset", offset)
    squares = torch.empty((M, column_tiles(M, N, K, x.dtype, config)), dtype=torch.float32, device=x.device)
    scaled = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if _launch(x, w, residual, None, residual, None, config, add_squares=(squares, scaled, weight, float(offset))):
        return residual, scaled, squares
    residual.copy_(residual + skinny_linear(x, w, config=config))  # apart: the same roundings
    rows = residual.float()
    scaled.copy_(rows * (offset + weight.float()))
    return residual, scaled, rows.pow(2).sum(-1, keepdim=True)


def skinny_linear_swiglu_ref(x: Float[Tensor, "M K"], w: Float[Tensor, "I2 K"]) -> Float[Tensor, "M I"]:
    """The unfused ops: the product rounded to ``x.dtype``, then ``silu(gate)`` rounded, then the product."""
    return silu_and_mul_ref((x.float() @ w.float().T).to(x.dtype))


def skinny_linear_gating(x: Float[Tensor, "M K"], w: Float[Tensor, "N K"], col: int, neg_decay: Float[Tensor, " H"],
                         dt_bias: Float[Tensor, " H"], *, rms=None, config: SkinnyConfig | None = None
                         ) -> tuple[Float[Tensor, "M N"], Float[Tensor, "M H"], Float[Tensor, "M H"]]:
    """``y = x @ w.T`` (as `skinny_linear`) and, from its columns ``[col, col + H)`` (GDN's b) and
    ``[col + H, col + 2H)`` (a), ``g = neg_decay * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``
    (``x.dtype``) as `gdn_gating` computes them: ``-> (y [M, N], g [M, H], beta [M, H])``. One launch: the
    tile that holds those columns writes g and beta too (an input projection, then its gating);
    ``neg_decay``, ``dt_bias``: fp32 ``[H]``. ``rms``: the product's rows scaled first, as `skinny_linear`'s."""
    _check(x, w, None, None, config, None, None, rms)
    M, N = x.shape[0], w.shape[0]
    H = neg_decay.shape[0] if isinstance(neg_decay, torch.Tensor) and neg_decay.dim() == 1 else None
    if H is None or neg_decay.dtype != torch.float32 or neg_decay.device != x.device or neg_decay.stride(0) != 1:
        raise ValueError(f"neg_decay: expected a contiguous [H] float32 tensor on {x.device}, got "
                         f"{getattr(neg_decay, 'shape', type(neg_decay).__name__)}")
    check_like("dt_bias", dt_bias, (H,), neg_decay, "neg_decay")
    if dt_bias.stride(0) != 1 and H > 1:
        raise ValueError(f"dt_bias: expected a contiguous tensor, got strides {dt_bias.stride()}")
    if isinstance(col, bool) or not isinstance(col, int) or not 0 <= col <= N - 2 * H:
        raise ValueError(f"col: expected an int in 0..{N - 2 * H} (b and a, {H} columns each, within the "
                         f"{N} outputs), got {col!r}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    g = torch.empty((M, H), dtype=torch.float32, device=x.device)
    beta = torch.empty((M, H), dtype=x.dtype, device=x.device)
    done = _launch(x, w, y, None, None, None, config, gating=(g, beta, neg_decay, dt_bias, col, H), rms=rms)
    if not done and rms is not None and M:  # a scaled launch that could not run wrote nothing
        y = skinny_linear(x, w, rms=rms, config=config)
    if not done and M and H:
        g, beta = gdn_gating(y[:, col + H:col + 2 * H], y[:, col:col + H], neg_decay, dt_bias)  # the gating apart
    return y, g, beta
