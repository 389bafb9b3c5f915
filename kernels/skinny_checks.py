"""The arguments of `skinny_linear` and its folds: its launch config (`SkinnyConfig`, checked at construction)
and the checks of every call. Every message names the argument, the expected and the actual value, and
nothing is launched before they pass.

Kept apart from the kernel so each file stays readable; `skinny_linear` and `skinny_folds` are the users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_finite_float, check_like, shares_storage
from .invariant import invariant_on

MAX_M = 64  # rows a call takes outside the invariant mode (any number in it: 16-row tiles over a grid)
ACTS = (None, "silu_mul")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape of `skinny_linear`: a program owns ``block_n`` output columns and ``1 / split_k`` of K.

    ``dot``: products by ``tl.dot`` (rows padded to 16); False: by FMAs and a sum over each K tile, which
    holds ``[M, block_n, block_k]`` products in registers (a form for a few rows only). ``one_launch``
    (with ``split_k > 1``): the last piece of each column tile sums the partials; False: a second kernel does.
    ``prefetch`` (launched with PDL only): before it waits for the launch before it, each program asks L2 for
    the rest of its weight slab, one ``prefetch.global.L2`` a cache line, beside loading its first tile.
    ``early``: the first load is ``early`` K tiles wide (``[block_n, early * block_k]``, one product), so
    under PDL that much of the slab is in registers before the wait; the rest streams a tile at a time.
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    one_launch: bool = True
    prefetch: bool = False
    early: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"SkinnyConfig.{name}: expected a power of two >= 16, got {v!r}")
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"SkinnyConfig.split_k: expected an int >= 1, got {self.split_k!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SkinnyConfig.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if isinstance(self.early, bool) or not isinstance(self.early, int) or self.early < 1 \
                or self.early & (self.early - 1):
            raise ValueError(f"SkinnyConfig.early: expected a power of two >= 1, got {self.early!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"SkinnyConfig.num_stages: expected an int >= 1, got {self.num_stages!r}")
        for name in ("dot", "one_launch", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SkinnyConfig.{name}: expected a bool, got {getattr(self, name)!r}")



def _check_act_norm(act, norm):
    if act not in ACTS:
        raise ValueError(f"act: expected None or 'silu_mul', got {act!r}")
    if norm is None:
        return None
    if not isinstance(norm, (tuple, list)) or len(norm) != 3:
        got = f"{type(norm).__name__} of {len(norm)}" if isinstance(norm, (tuple, list)) else type(norm).__name__
        raise ValueError(f"norm: expected a (weight, eps, offset) triple, got {got}")
    if act is not None:
        raise ValueError(f"norm and act: expected at most one of them (the norm is of x's rows, act {act!r} "
                         f"reads gate | up), got both")
    weight, eps, offset = norm
    for name, v in (("eps", eps), ("offset", offset)):
        check_finite_float(f"norm {name}", v)
    if eps < 0:
        raise ValueError(f"norm eps: expected >= 0, got {eps!r}")
    return weight, float(eps), float(offset)


def _check(x, w, out, act, config, residual=None, norm=None, rms=None):
    norm = _check_act_norm(act, norm)
    if rms is not None and (act is not None or norm is not None):
        raise ValueError(f"rms: expected no act or norm beside it (the row scale is of the product), got "
                         f"act={act!r}, norm={'given' if norm is not None else None}")
    if config is not None and not isinstance(config, SkinnyConfig):
        raise ValueError(f"config: expected a SkinnyConfig or None, got {type(config).__name__}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 2-D tensor, got {shape}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: expected dtype bfloat16, float16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"w: expected dtype {x.dtype} (x's), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected device {x.device} (x's), got {w.device}")
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    if M > MAX_M and not invariant_on():
        raise ValueError(f"x: expected at most {MAX_M} rows (any number in the invariant mode), got {M}")
    width = 2 * K if act == "silu_mul" else K
    if x.shape[1] != width:
        what = f"[M, 2 * {K}] (gate | up for w's K={K})" if act == "silu_mul" else f"[M, {K}] (w's K)"
        raise ValueError(f"x: expected shape {what}, got {tuple(x.shape)}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"x: expected unit stride along its last dim, got strides {x.stride()}")
    if not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous tensor, got strides {w.stride()} for shape {tuple(w.shape)}")
    _check_operand("residual", residual, (M, N), x, row_strided=True)
    if norm is not None:
        _check_operand("norm weight", norm[0], (K,), x, row_strided=False)
    if rms is not None:
        if not isinstance(rms, (tuple, list)) or len(rms) != 2:
            raise ValueError(f"rms: expected a (squares, eps) pair, got {type(rms).__name__}")
        check_squares("rms squares", rms[0], M, x)
        check_finite_float("rms eps", rms[1])
        if rms[1] < 0:
            raise ValueError(f"rms eps: expected >= 0, got {rms[1]!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (M, N) or out.dtype not in (x.dtype, torch.float32):
            got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
            dtypes = str(x.dtype) if x.dtype == torch.float32 else f"{x.dtype} or torch.float32 (widened)"
            raise ValueError(f"out: expected shape {(M, N)} dtype {dtypes}, got {got}")
        if out.device != x.device:
            raise ValueError(f"out: expected device {x.device} (x's), got {out.device}")
        if out.stride(1) != 1 and N > 1:
            raise ValueError(f"out: expected unit stride along its last dim, got strides {out.stride()}")
        # Programs read x (and the residual) while others write out: a shared buffer would be read half-written.
        for name, t in (("x", x), ("residual", residual)):
            if t is not None and shares_storage(out, t):
                raise ValueError(f"out: expected a buffer apart from {name}'s, got one sharing {name}'s storage")
    return norm


def check_squares(name, t, M, x):
    """Sums of squares of x's rows in pieces: fp32 ``[M, P]`` (P >= 1, unit stride along P) on x's device."""
    ok = isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == M and t.shape[1] >= 1
    if not ok or t.dtype != torch.float32 or t.device != x.device or (t.shape[1] > 1 and t.stride(1) != 1):
        got = (tuple(t.shape), t.dtype, str(t.device), t.stride()) if isinstance(t, torch.Tensor) \
            else type(t).__name__
        raise ValueError(f"{name}: expected a float32 [{M}, P] tensor (P >= 1, unit stride along P) on {x.device}, "
                         f"got {got}")


def _check_operand(name, t, shape, x, *, row_strided):
    """``residual`` ([M, N], rows may be strided) or the norm's ``weight`` ([K], contiguous): x's dtype, device."""
    if t is None:
        return
    check_like(name, t, shape, x, "x")
    if shape[-1] > 1 and t.stride(-1) != 1:
        what = "unit stride along its last dim" if row_strided else "a contiguous tensor"
        raise ValueError(f"{name}: expected {what}, got strides {t.stride()}")
