"""What the CPU ``sdpa`` backends of every kind share: torch's fused CPU attention kernel, called directly, and
the layout helpers around it.

``F.scaled_dot_product_attention`` dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` on a
CPU; called directly it also returns the log-sum-exp, which outputs carry and merges need. Query heads that
share one K/V head (GQA, or MQA: every MLA head over the one latent head, every DeepSeek-V4 head over its
shared K = V rows) are folded into the query axis, so the shared head is read once and never repeated.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .availability import needs_dtype

_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(spec, device) -> list[str]:
    """A CPU model in a dtype the kernel takes."""
    reasons = [] if device.type == "cpu" else [f"runs on CPU, the model runs on {device.type}"]
    return reasons + needs_dtype(spec, DTYPES)


def flash(q: Float[Tensor, "b h n d"], k: Float[Tensor, "b hk m d"], v: Float[Tensor, "b hk m dv"], **options):
    """The fused kernel (outputs: ``o``, ``lse``, ...). It reads the head dim as packed whatever its stride says, so
    a valid view strided there (a slice of a wider head dim) gave the values beside the ones asked for: such an
    operand is copied first. Other strides it honours, so column slices and head-major layouts are read in place."""
    q, k, v = (x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous() for x in (q, k, v))
    return _kernel(q, k, v, **options)


def heads_first(x: Float[Tensor, "m H D"]) -> Float[Tensor, "1 H m D"]:
    return x.transpose(0, 1)[None]  # [m, H, D] -> [1, H, m, D]


def fold_heads(q: Float[Tensor, "n Hq D"], g: int) -> Float[Tensor, "1 Hkv gn D"]:
    """``[n, Hq, D] -> [1, Hkv, g n, D]``: the ``g`` query heads of one K/V head stacked along the query axis
    (row ``j * n + t`` of K/V head ``h`` is token ``t`` of query head ``h * g + j``)."""
    n, hq, d = q.shape
    return q.view(n, hq // g, g, d).permute(1, 2, 0, 3).reshape(1, hq // g, g * n, d)


def unfold_heads(o: Float[Tensor, "1 Hkv gn D"], lse: Float[Tensor, "1 Hkv gn"], n: int, g: int
                 ) -> tuple[Float[Tensor, "n Hq D"], Float[Tensor, "n Hq"]]:
    """Inverse of `fold_heads` for the output ``[1, Hkv, g n, D]`` and its LSE ``[1, Hkv, g n]``:
    ``-> ([n, Hq, D], [n, Hq])``."""
    hkv, d = o.shape[1], o.shape[-1]
    o = o[0].view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d)
    lse = lse[0].view(hkv, g, n).permute(2, 0, 1).reshape(n, hkv * g)
    return o, lse


def additive_mask(visible: Bool[Tensor, "n m"], dtype: torch.dtype, g: int = 1) -> Float[Tensor, "gn m"]:
    """The kernel's mask (it takes the query's dtype, not bool): 0 where ``visible``, -inf elsewhere, the rows
    repeated for ``g`` folded heads."""
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill(~visible, float("-inf")).repeat(g, 1)


def without_blind_rows(o: Float[Tensor, "n H D"], lse: Float[Tensor, "n H"], visible: Bool[Tensor, "n N"]
                       ) -> tuple[Float[Tensor, "n H D"], Float[Tensor, "n H"]]:
    """``o [n, H, D]``, ``lse [n, H]`` with the rows of queries that see no key (``visible [n, N]``) set as the
    references set them, ``o = 0`` and ``lse = -inf`` (the kernel leaves them undefined)."""
    blind = ~visible.any(-1)  # [n]
    return o.masked_fill(blind[:, None, None], 0.0), lse.masked_fill(blind[:, None], float("-inf"))
