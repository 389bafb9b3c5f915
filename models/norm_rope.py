"""RMSNorm, rotary position embeddings and the plain projection (`row_linear`): the torch math of every model
family and of `models.fused`'s torch bodies.

fp32 statistics and angles, results in the activation dtype, matching the Hugging Face modules they stand in
for. These are the only RMSNorm and rope in the package: every family, the MLA and DSA layers and the gated
output norms of GDN / KDA call them (most through `models.common`, which re-exports them). The module imports
no other model module, so both `models.common` and `models.fused` stand on it.
"""

from __future__ import annotations

import math

import torch
from fnattn.kernels.invariant import invariant_on, linear_rows, pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn.checks import expect_shape


def row_linear(x: Float[Tensor, "... K"], w: Float[Tensor, "N K"],
               bias: Tensor | None = None) -> Float[Tensor, "... N"]:
    """``F.linear(x, w, bias)``; in the invariant mode a projection's row does not change with the rows beside it
    (a verify's tokens, a batch's requests, an expert's share of a MoE step): on the CPU each row is its own
    product (`fnattn.kernels.invariant.linear_rows`), on CUDA the fixed-tile Triton GEMM
    (`fnattn.kernels.invariant_linear`)."""
    if invariant_on():
        if x.device.type == "cpu":
            return linear_rows(x, w, bias)
        if x.is_cuda:
            from fnattn.kernels.invariant_linear import invariant_linear

            return invariant_linear(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def rms_norm(
    x: Float[Tensor, "*B C"], weight: Float[Tensor, " C"] | None, eps: float, *, offset: float = 0.0
) -> Float[Tensor, "*B C"]:
    """RMSNorm: statistics in fp32, the normalised value rounded to ``x.dtype``, then times ``weight``.

    ``offset=1.0`` for checkpoints that store ``weight - 1`` (Qwen3-Next /
    Qwen3.5); there the scale ``1 + weight`` is applied in fp32 before the one
    rounding, as those modules do. ``weight=None``: no scale.
    """
    xf = x.float()
    squares = row_mean_squares(xf) if invariant_on() and x.is_cuda else xf.pow(2).mean(-1, keepdim=True)
    y = xf * torch.rsqrt(squares + eps)
    if weight is None:
        return y.to(x.dtype)
    if offset:
        return (y * (offset + weight.float())).to(x.dtype)
    return y.to(x.dtype) * weight


def row_mean_squares(xf: Float[Tensor, "*B C"]) -> Float[Tensor, "*B 1"]:
    """The mean of each row's squares (fp32), summed in one order whatever the number of rows: the invariant
    mode's RMSNorm statistics on CUDA. Torch's CUDA reduction picks its thread layout from the number of rows
    (with few rows it also splits each row's sum across a block's rows), so a token's norm would round
    differently in a decode step and in a verify; a product with a ones column through the fixed-tile GEMM
    (`fnattn.kernels.invariant_linear`) sums every row in the same order."""
    from fnattn.kernels.invariant_linear import invariant_linear

    C = xf.shape[-1]
    ones = torch.ones(1, C, dtype=torch.float32, device=xf.device)
    return invariant_linear(xf.pow(2), ones) / C


def rope_inv_freq(rotary_dim: int, theta: float, *, device: torch.device | str | None = None) -> Float[Tensor, " Dr2"]:
    """The default rope frequencies ``theta ** (-2j / rotary_dim)``, fp32 (``[rotary_dim / 2]``)."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)


def llama3_inv_freq(inv_freq: Float[Tensor, " Dr2"], *, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> Float[Tensor, " Dr2"]:
    """Llama 3.1's rope scaling (``rope_type: "llama3"``) of the default frequencies, as transformers computes it.

    Wavelengths shorter than ``original / high_freq_factor`` are kept, those
    longer than ``original / low_freq_factor`` divided by ``factor``, and the
    band between interpolated smoothly.
    """
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: Int[Tensor, " T"],
    inv_freq: Float[Tensor, " Dr2"],
    *,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Float[Tensor, "T Dr"], Float[Tensor, "T Dr"]]:
    """``(cos, sin)`` for absolute ``positions``, laid out as ``cat(f, f)`` (each frequency twice).

    Same values as the ``transformers`` rotary modules: angles in fp32,
    multiplied by ``attention_scaling`` (YaRN's ``attention_factor``), then cast
    to ``dtype``.
    """
    expect_shape("positions", positions, (None,))
    expect_shape("inv_freq", inv_freq, (None,))
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, Dr / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, Dr]
    cos, sin = pointwise(lambda a: (a.cos(), a.sin()), angles)
    if attention_scaling != 1.0:  # a product by one is exact: two launches a step saved
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(
    x: Float[Tensor, "T *heads D"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    *,
    interleave: bool = False,
) -> Float[Tensor, "T *heads D"]:
    """Rotate the first ``Dr = cos.shape[-1]`` dims of ``x`` (``[T, D]`` or ``[T, H, D]``); the rest pass through.

    ``cos`` / ``sin`` are ``cat(f, f)`` as `rope_cos_sin` and the rotary
    modules produce them. ``Dr < D`` is partial rotary (Qwen3.5's
    ``partial_rotary_factor``, the DSA indexer's rope on its first dims).

    * ``interleave=False``: the two halves of the rotated dims form the pairs
      (``x[j]``, ``x[j + Dr/2]``) — the usual "rotate half" convention.
    * ``interleave=True``: adjacent dims form the pairs (``x[2j]``,
      ``x[2j+1]``), as in DeepSeek checkpoints. The result is written
      de-interleaved: rotated even dims first, then rotated odd dims. This is
      the layout ``transformers`` computes and caches; dot products between two
      vectors rotated this way are the same as with the interleaved layout.

    The rotation runs in the wider of ``x``'s and ``cos``'s dtypes (fp32 tables
    give fp32 math on bf16 activations) and the result is in ``x.dtype``.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected shape [T, D] or [T, H, D], got {list(x.shape)}")
    T, Dr = x.shape[0], cos.shape[-1]
    if Dr % 2:
        raise ValueError(f"cos: expected an even rope dim, got {Dr}")
    if x.shape[-1] < Dr:
        raise ValueError(f"x: expected at least the {Dr} rope dims in the last dim, got {x.shape[-1]}")
    expect_shape("cos", cos, (T, Dr))
    expect_shape("sin", sin, (T, Dr))
    if x.dim() == 3:  # broadcast over heads
        cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :Dr], x[..., Dr:]
    if interleave:
        cos, sin = cos[..., : Dr // 2], sin[..., : Dr // 2]
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    else:
        first, second = rot[..., : Dr // 2], rot[..., Dr // 2 :]
        out = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((out.to(x.dtype), rest), dim=-1)
