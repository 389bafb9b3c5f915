"""DeepSeek's MLA attention block (``DeepseekV3Attention``) as functions of its checkpoint weights.

``MLAWeights`` holds one block's tensors under their ``transformers`` names
(``kv_b_proj`` stored split into ``w_uk`` / ``w_uv``); ``mla_project`` turns
the block's normalised input into what the attention core reads (queries and
the cache rows ``[c_kv, k_pe]``, rope applied); ``attend_and_project`` runs the
core (``fnattn.kinds.mla.math``) over the cached rows and applies ``o_proj``.
``mla_layer`` is both, the whole block for one request, and the ground truth
the model steps and the DSA layer (``models/dsa_layer.py``) build on.

The cached ``k_pe`` is de-interleaved when the checkpoint's rope is
interleaved, as ``transformers`` caches it (see ``common.apply_rope``).
Dimension names: T new tokens, H heads, Dn / Dr / Dv no-rope, rope and value
head dims, R ``kv_lora_rank``, Dlat = R + Dr, Dm model hidden size, Rq
``q_lora_rank``. No input is modified.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kinds.mla.math import AttentionForm, mla_attention

from .common import apply_rope, rms_norm
from .norm_rope import row_linear

__all__ = [
    "MLALayerResult",
    "MLAProjection",
    "MLAWeights",
    "attend_and_project",
    "mla_layer",
    "mla_project",
    "mla_shapes",
    "mla_softmax_scale",
    "pad_heads",
    "padded_kv_b",
    "unpad_heads",
]


def mla_softmax_scale(*, qk_head_dim: int, rope_parameters: Mapping[str, Any] | None = None) -> float:
    """Softmax scale of DeepSeek MLA: ``qk_head_dim ** -0.5``, times ``m**2``
    when the rope type is not ``"default"`` and ``mscale_all_dim`` is set, with
    ``m = 0.1 * mscale_all_dim * ln(factor) + 1`` (``m = 1`` for ``factor <= 1``).

    ``qk_head_dim`` is ``Dn + Dr``; ``rope_parameters`` is the config's
    ``rope_parameters`` (or legacy ``rope_scaling``) dict.
    """
    scale = qk_head_dim**-0.5
    params = rope_parameters or {}
    if params.get("rope_type", params.get("type", "default")) == "default":
        return scale
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return scale
    factor = params["factor"]
    m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * m * m


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


def _take(sd: Mapping[str, Tensor], key: str, *, required: bool = True) -> Tensor | None:
    if key in sd:
        return sd[key].detach()
    if required:
        raise ValueError(f"state_dict: missing key {key!r}")
    return None


@dataclass(frozen=True, eq=False)
class MLAWeights:
    """Weights of one DeepSeek MLA attention block (``transformers`` layout).

    The query path is either ``q_proj`` alone (``q_lora_rank`` None) or
    ``q_a_proj`` -> RMSNorm(``q_a_norm``) -> ``q_b_proj``. ``kv_b_proj`` is
    stored split into ``w_uk`` and ``w_uv``. Linear weights are
    ``[out_features, in_features]``. Build one with ``from_state_dict``.
    """

    kv_a_proj: Float[Tensor, "Dlat Dm"]
    kv_a_norm: Float[Tensor, " R"]
    w_uk: Float[Tensor, "H Dn R"]
    w_uv: Float[Tensor, "H Dv R"]
    o_proj: Float[Tensor, "Dm HDv"]
    q_proj: Float[Tensor, "HDq Dm"] | None = None
    q_a_proj: Float[Tensor, "Rq Dm"] | None = None
    q_a_norm: Float[Tensor, " Rq"] | None = None
    q_b_proj: Float[Tensor, "HDq Rq"] | None = None
    q_a_proj_bias: Float[Tensor, " Rq"] | None = None
    kv_a_proj_bias: Float[Tensor, " Dlat"] | None = None
    o_proj_bias: Float[Tensor, " Dm"] | None = None
    #: eps of ``q_a_layernorm`` / ``kv_a_layernorm``. transformers builds both
    #: with the RMSNorm default 1e-6, not ``config.rms_norm_eps``.
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        expect_shape("w_uk", self.w_uk, (None, None, None))
        H, Dn, R = self.w_uk.shape
        expect_shape("w_uv", self.w_uv, (H, None, R))
        expect_shape("kv_a_norm", self.kv_a_norm, (R,))
        expect_shape("kv_a_proj", self.kv_a_proj, (None, None))
        Dlat, Dm = self.kv_a_proj.shape
        if Dlat <= R:
            raise ValueError(f"kv_a_proj: expected more than R={R} output rows (R + Dr), got {Dlat}")
        Dr = Dlat - R
        expect_shape("o_proj", self.o_proj, (Dm, H * self.w_uv.shape[1]))
        q_rows = H * (Dn + Dr)
        if self.q_proj is not None:
            if any(t is not None for t in (self.q_a_proj, self.q_a_norm, self.q_b_proj, self.q_a_proj_bias)):
                raise ValueError("q_proj: give either q_proj or q_a_proj/q_a_norm/q_b_proj, not both")
            expect_shape("q_proj", self.q_proj, (q_rows, Dm))
        else:
            if self.q_a_proj is None or self.q_a_norm is None or self.q_b_proj is None:
                raise ValueError("q_a_proj: expected q_proj, or all of q_a_proj, q_a_norm and q_b_proj")
            expect_shape("q_a_proj", self.q_a_proj, (None, Dm))
            Rq = self.q_a_proj.shape[0]
            expect_shape("q_a_norm", self.q_a_norm, (Rq,))
            expect_shape("q_b_proj", self.q_b_proj, (q_rows, Rq))
            if self.q_a_proj_bias is not None:
                expect_shape("q_a_proj_bias", self.q_a_proj_bias, (Rq,))
        if self.kv_a_proj_bias is not None:
            expect_shape("kv_a_proj_bias", self.kv_a_proj_bias, (Dlat,))
        if self.o_proj_bias is not None:
            expect_shape("o_proj_bias", self.o_proj_bias, (Dm,))

    num_heads = property(lambda self: self.w_uk.shape[0])
    qk_nope_head_dim = property(lambda self: self.w_uk.shape[1])
    kv_lora_rank = property(lambda self: self.w_uk.shape[2])
    v_head_dim = property(lambda self: self.w_uv.shape[1])
    qk_rope_head_dim = property(lambda self: self.kv_a_proj.shape[0] - self.w_uk.shape[2])
    hidden_size = property(lambda self: self.kv_a_proj.shape[1])
    q_lora_rank = property(lambda self: None if self.q_a_proj is None else self.q_a_proj.shape[0])

    @staticmethod
    def state_dict_shapes(
        *,
        prefix: str = "",
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool,
    ) -> dict[str, tuple[int, ...]]:
        """The shape of every key `from_state_dict` reads, for a config (checkpoint checks)."""
        p, D, H, R, Dr = prefix, hidden_size, num_heads, kv_lora_rank, qk_rope_head_dim
        Dq = qk_nope_head_dim + Dr
        if q_lora_rank is None:
            shapes = {p + "q_proj.weight": (H * Dq, D)}
        else:
            Rq = q_lora_rank
            shapes = {p + "q_a_proj.weight": (Rq, D), p + "q_a_layernorm.weight": (Rq,),
                      p + "q_b_proj.weight": (H * Dq, Rq)}
            if bias:
                shapes[p + "q_a_proj.bias"] = (Rq,)
        shapes.update({p + "kv_a_proj_with_mqa.weight": (R + Dr, D), p + "kv_a_layernorm.weight": (R,),
                       p + "kv_b_proj.weight": (H * (qk_nope_head_dim + v_head_dim), R),
                       p + "o_proj.weight": (D, H * v_head_dim)})
        if bias:
            shapes.update({p + "kv_a_proj_with_mqa.bias": (R + Dr,), p + "o_proj.bias": (D,)})
        return shapes

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        *,
        prefix: str = "",
        num_heads: int | None = None,
        norm_eps: float = 1e-6,
    ) -> MLAWeights:
        """Build from ``transformers`` parameter names under ``prefix``.

        ``prefix`` is ``""`` for ``attn.state_dict()`` of one attention module
        and e.g. ``"model.layers.3.self_attn."`` for a whole model. Keys read:
        ``q_proj.weight`` or ``q_a_proj.weight`` (+ ``.bias``),
        ``q_a_layernorm.weight``, ``q_b_proj.weight``;
        ``kv_a_proj_with_mqa.weight`` (+ ``.bias``), ``kv_a_layernorm.weight``,
        ``kv_b_proj.weight``, ``o_proj.weight`` (+ ``.bias``). Other keys are
        ignored. Head count and head dims follow from the weight shapes;
        ``num_heads``, when given, is checked against them.
        """
        p = prefix
        kv_a = _take(state_dict, p + "kv_a_proj_with_mqa.weight")
        kv_norm = _take(state_dict, p + "kv_a_layernorm.weight")
        kv_b = _take(state_dict, p + "kv_b_proj.weight")
        o_proj = _take(state_dict, p + "o_proj.weight")
        q_proj = _take(state_dict, p + "q_proj.weight", required=False)
        q_b = None if q_proj is not None else _take(state_dict, p + "q_b_proj.weight")
        R = kv_norm.shape[0]
        Dr = kv_a.shape[0] - R
        # kv_b rows = H*(Dn+Dv), q rows = H*(Dn+Dr), o_proj cols = H*Dv.
        kv_b_rows, q_rows, o_cols = kv_b.shape[0], (q_proj if q_proj is not None else q_b).shape[0], o_proj.shape[1]
        H_times_Dr = q_rows - (kv_b_rows - o_cols)
        if Dr <= 0 or H_times_Dr <= 0 or H_times_Dr % Dr:
            raise ValueError(
                f"state_dict: inconsistent MLA shapes (kv_a_proj {list(kv_a.shape)}, kv_b_proj "
                f"{list(kv_b.shape)}, q rows {q_rows}, o_proj {list(o_proj.shape)})"
            )
        H = H_times_Dr // Dr
        if num_heads is not None and num_heads != H:
            raise ValueError(f"num_heads: expected {H} from the weight shapes, got {num_heads}")
        Dv = o_cols // H
        Dn = kv_b_rows // H - Dv
        w_uk, w_uv = kv_b.reshape(H, Dn + Dv, R).split([Dn, Dv], dim=1)
        return cls(
            kv_a_proj=kv_a,
            kv_a_norm=kv_norm,
            w_uk=w_uk,
            w_uv=w_uv,
            o_proj=o_proj,
            q_proj=q_proj,
            q_a_proj=None if q_proj is not None else _take(state_dict, p + "q_a_proj.weight"),
            q_a_norm=None if q_proj is not None else _take(state_dict, p + "q_a_layernorm.weight"),
            q_b_proj=q_b,
            q_a_proj_bias=_take(state_dict, p + "q_a_proj.bias", required=False),
            kv_a_proj_bias=_take(state_dict, p + "kv_a_proj_with_mqa.bias", required=False),
            o_proj_bias=_take(state_dict, p + "o_proj.bias", required=False),
            norm_eps=norm_eps,
        )


def mla_shapes(cfg, prefix: str) -> dict[str, tuple[int, ...]]:
    """`MLAWeights.state_dict_shapes` under ``prefix``, for any model config with DeepSeek's MLA fields."""
    return MLAWeights.state_dict_shapes(
        prefix=prefix, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias)


# --------------------------------------------------------------------------- #
# The block
# --------------------------------------------------------------------------- #


class MLAProjection(NamedTuple):
    """Per-token projections of one MLA layer for the new tokens.

    ``latent_rows`` is what the cache stores for them (``[c_kv, k_pe]``, rope
    applied). ``q_resid`` is the normalised q latent (``q_a_layernorm``
    output) that the DSA indexer reads; ``None`` without ``q_lora_rank``.
    """

    q_nope: Float[Tensor, "T H Dn"]
    q_pe: Float[Tensor, "T H Dr"]
    latent_rows: Float[Tensor, "T Dlat"]
    q_resid: Float[Tensor, "T Rq"] | None


class MLALayerResult(NamedTuple):
    """``output`` of the attention block (after ``o_proj``), the cache rows
    the caller appends, and the attention ``lse``."""

    output: Float[Tensor, "T Dm"]
    latent_rows: Float[Tensor, "T Dlat"]
    lse: Float[Tensor, "T H"]


def mla_project(
    weights: MLAWeights,
    hidden: Float[Tensor, "T Dm"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    *,
    rope_interleave: bool = True,
) -> MLAProjection:
    """Queries and cache rows of the new tokens, as ``DeepseekV3Attention``
    computes them: the q path, ``kv_a_proj_with_mqa`` split into latent and
    rope key, RMSNorm on the latent, rope on ``q_pe`` and ``k_pe``."""
    expect_float("hidden", hidden)
    expect_shape("hidden", hidden, (None, weights.hidden_size))
    T, H = hidden.shape[0], weights.num_heads
    Dn, Dr, R = weights.qk_nope_head_dim, weights.qk_rope_head_dim, weights.kv_lora_rank
    expect_shape("cos", cos, (T, Dr))
    expect_shape("sin", sin, (T, Dr))
    if weights.q_proj is not None:
        q_resid = None
        q = row_linear(hidden, weights.q_proj)
    else:
        q_a = row_linear(hidden, weights.q_a_proj, weights.q_a_proj_bias)
        q_resid = rms_norm(q_a, weights.q_a_norm, eps=weights.norm_eps)
        q = row_linear(q_resid, weights.q_b_proj)
    q_nope, q_pe = q.reshape(T, H, Dn + Dr).split([Dn, Dr], dim=-1)
    c_kv, k_pe = row_linear(hidden, weights.kv_a_proj, weights.kv_a_proj_bias).split([R, Dr], dim=-1)
    c_kv = rms_norm(c_kv, weights.kv_a_norm, eps=weights.norm_eps)
    q_pe = apply_rope(q_pe, cos, sin, interleave=rope_interleave)
    k_pe = apply_rope(k_pe, cos, sin, interleave=rope_interleave)
    return MLAProjection(q_nope, q_pe, torch.cat((c_kv, k_pe), dim=-1), q_resid)


def _check_cached_latent(weights: MLAWeights, cached_latent: Tensor, new_rows: Tensor) -> None:
    expect_shape("cached_latent", cached_latent, (None, weights.kv_lora_rank + weights.qk_rope_head_dim))
    if cached_latent.dtype != new_rows.dtype:
        raise ValueError(f"cached_latent: expected dtype {new_rows.dtype}, got {cached_latent.dtype}")


def attend_and_project(
    weights: MLAWeights,
    projection: MLAProjection,
    cached_latent: Float[Tensor, "Nc Dlat"],
    *,
    scale: float,
    allowed: Bool[Tensor, "T N"] | None = None,
    form: AttentionForm = "absorbed",
) -> MLALayerResult:
    """Attend the new tokens' queries over ``cached_latent`` + their own rows
    (causal), then apply ``o_proj``. Shared by ``mla_layer`` and ``dsa_layer``."""
    _check_cached_latent(weights, cached_latent, projection.latent_rows)
    latent = torch.cat((cached_latent, projection.latent_rows), dim=0)
    o, lse = mla_attention(
        projection.q_nope,
        projection.q_pe,
        latent,
        weights.w_uk,
        weights.w_uv,
        scale=scale,
        n_cached=cached_latent.shape[0],
        allowed=allowed,
        form=form,
    )
    T = o.shape[0]
    output = row_linear(o.reshape(T, -1), weights.o_proj, weights.o_proj_bias)
    return MLALayerResult(output, projection.latent_rows, lse)


def mla_layer(
    weights: MLAWeights,
    hidden: Float[Tensor, "T Dm"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    cached_latent: Float[Tensor, "Nc Dlat"],
    *,
    scale: float,
    rope_interleave: bool = True,
    form: AttentionForm = "absorbed",
) -> MLALayerResult:
    """``DeepseekV3Attention`` for the new tokens of one request.

    ``hidden`` is the layer's (already normalised) input for the new tokens;
    ``cos`` / ``sin`` the rotary embedding at their positions (from the model's
    rotary module or ``common.rope_cos_sin``, YaRN ``attention_factor`` included);
    ``cached_latent`` the rows of the earlier tokens, in order. ``scale`` is
    ``mla_softmax_scale(...)``. ``rope_interleave`` is the config field of the
    same name (True for DeepSeek-V3 checkpoints). Returns the block output and
    the new tokens' cache rows.
    """
    projection = mla_project(weights, hidden, cos, sin, rope_interleave=rope_interleave)
    return attend_and_project(weights, projection, cached_latent, scale=scale, form=form)


# --------------------------------------------------------------------------- #
# Kernel head padding
# --------------------------------------------------------------------------- #
# Some MLA kernels take only 64 or 128 query heads. The layer's `MLAConfig.padded_heads` says how many the
# inputs carry; the model pads with zero heads here and drops them again, so no backend ever guesses the
# model's own head count. A zero query head over zero W_UK / W_UV rows attends uniformly and reads out 0.

_PADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pad_heads(x: Float[Tensor, "T H D"], heads: int) -> Float[Tensor, "T Hp D"]:
    """``x`` with zero heads appended up to ``heads`` (itself when it has them already)."""
    expect_shape("x", x, (None, None, None))
    H = x.shape[1]
    if heads < H:
        raise ValueError(f"heads: expected >= {H} (the tensor's heads), got {heads}")
    return x if heads == H else F.pad(x, (0, 0, 0, heads - H))


def padded_kv_b(weights: MLAWeights, heads: int) -> tuple[Float[Tensor, "Hp Dn R"], Float[Tensor, "Hp Dv R"]]:
    """``w_uk`` / ``w_uv`` with zero heads up to ``heads``, built once per weights and head count."""
    if heads == weights.num_heads:
        return weights.w_uk, weights.w_uv
    per = _PADDED.setdefault(weights, {})
    if heads not in per:
        extra = heads - weights.num_heads
        if extra < 0:
            raise ValueError(f"heads: expected >= {weights.num_heads} (the weights' heads), got {heads}")
        per[heads] = tuple(F.pad(w, (0, 0, 0, 0, 0, extra)) for w in (weights.w_uk, weights.w_uv))  # [Hp, *, R]
    return per[heads]


def unpad_heads(o: Float[Tensor, "T Hp Dv"], num_heads: int) -> Float[Tensor, "T H Dv"]:
    """The model's own ``num_heads`` heads of a padded output."""
    expect_shape("o", o, (None, None, None))
    if o.shape[1] < num_heads:
        raise ValueError(f"o: expected at least {num_heads} heads, got {o.shape[1]}")
    return o[:, :num_heads]
