"""The attention block of DeepSeek-V3.2 / GLM-5 (MLA + the DSA lightning indexer) from its checkpoint weights.

``IndexerWeights`` holds one indexer's tensors under their ``transformers``
names; ``indexer_keys`` / ``indexer_queries`` compute what the selection
(``fnattn.kinds.sparse_mla.indexer``) scores, as ``transformers`` computes them (no fp8, no
Hadamard rotation: the rotation is orthogonal and leaves ``q . k`` unchanged):

* ``q = wq_b(q_resid)`` per head, from the MLA q latent after
  ``q_a_layernorm``; ``k = LayerNorm(wk(x))`` (weight and bias, eps 1e-6).
* rope acts on the **first** ``Dr`` dims of q and k (``Dr =
  qk_rope_head_dim``, same ``cos``/``sin`` as the MLA block); the remaining
  ``Di - Dr`` dims pass through. DeepSeek-V3.2 uses the half-split convention,
  GLM-5 (``glm_moe_dsa``) the interleaved one (``INDEXER_ROPE_INTERLEAVE``).
* head weights ``w = weights_proj(x) * Hi ** -0.5``; ``weights_proj`` runs in
  its own dtype (the checkpoints keep it in fp32) and its output is cast to fp32.

GLM-5 layers may reuse an earlier layer's top-k instead of running an indexer
(``glm_indexer_types``, ``topk_source_layers``). ``dsa_layer`` is the whole
block for one request: MLA (``models/mla_layer.py``) restricted per query to
the top-k. Dimension names: Hi indexer heads, Di indexer head dim, Rq
``q_lora_rank``, topk selected tokens per query; others as in
``models/mla_layer.py``. No input is modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kinds.mla.math import AttentionForm
from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices, topk_mask

from .common import apply_rope
from .mla_layer import MLAWeights, attend_and_project, mla_project
from .norm_rope import row_linear

__all__ = [
    "INDEXER_ROPE_INTERLEAVE",
    "DSALayerResult",
    "IndexerQueries",
    "IndexerWeights",
    "dsa_layer",
    "glm_indexer_types",
    "indexer_keys",
    "indexer_queries",
    "topk_source_layers",
]

#: Rope convention of the indexer, by Hugging Face ``model_type``, as
#: ``transformers`` applies it. The MLA block itself uses interleaved rope in
#: both models. Some ``glm_moe_dsa`` config files also carry an
#: ``indexer_rope_interleave`` field; ``transformers`` does not read it.
INDEXER_ROPE_INTERLEAVE: dict[str, bool] = {"deepseek_v32": False, "glm_moe_dsa": True}


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, eq=False)
class IndexerWeights:
    """Weights of one DSA indexer (``transformers`` layout, ``[out, in]``).

    Build one with ``from_state_dict``. The rope dims are those of the MLA
    block (``cos.shape[-1]``), so they are not stored here.
    """

    wq_b: Float[Tensor, "HiDi Rq"]
    wk: Float[Tensor, "Di Dm"]
    k_norm_weight: Float[Tensor, " Di"]
    k_norm_bias: Float[Tensor, " Di"]
    weights_proj: Float[Tensor, "Hi Dm"]
    k_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        expect_shape("weights_proj", self.weights_proj, (None, None))
        Hi, Dm = self.weights_proj.shape
        expect_shape("wk", self.wk, (None, Dm))
        Di = self.wk.shape[0]
        expect_shape("wq_b", self.wq_b, (Hi * Di, None))
        expect_shape("k_norm_weight", self.k_norm_weight, (Di,))
        expect_shape("k_norm_bias", self.k_norm_bias, (Di,))

    n_heads = property(lambda self: self.weights_proj.shape[0])
    head_dim = property(lambda self: self.wk.shape[0])
    hidden_size = property(lambda self: self.wk.shape[1])
    q_lora_rank = property(lambda self: self.wq_b.shape[1])

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, Tensor], *, prefix: str = "indexer.", k_norm_eps: float = 1e-6
    ) -> IndexerWeights:
        """Build from ``transformers`` parameter names under ``prefix``.

        The default prefix fits ``attn.state_dict()`` of one attention module;
        for a whole model use e.g. ``"model.layers.3.self_attn.indexer."``.
        Keys read: ``wq_b.weight``, ``wk.weight``, ``k_norm.weight``,
        ``k_norm.bias``, ``weights_proj.weight``.
        """

        def take(name: str) -> Tensor:
            if prefix + name not in state_dict:
                raise ValueError(f"state_dict: missing key {prefix + name!r}")
            return state_dict[prefix + name].detach()

        return cls(
            wq_b=take("wq_b.weight"),
            wk=take("wk.weight"),
            k_norm_weight=take("k_norm.weight"),
            k_norm_bias=take("k_norm.bias"),
            weights_proj=take("weights_proj.weight"),
            k_norm_eps=k_norm_eps,
        )


# --------------------------------------------------------------------------- #
# Indexer queries and keys
# --------------------------------------------------------------------------- #


def indexer_keys(
    weights: IndexerWeights,
    hidden: Float[Tensor, "T Dm"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    *,
    rope_interleave: bool,
) -> Float[Tensor, "T Di"]:
    """The indexer key of each new token: what the cache stores per token."""
    expect_float("hidden", hidden)
    expect_shape("hidden", hidden, (None, weights.hidden_size))
    Di = weights.head_dim
    k = row_linear(hidden, weights.wk)  # [T, Di]
    k = F.layer_norm(k, (Di,), weights.k_norm_weight, weights.k_norm_bias, weights.k_norm_eps)
    return apply_rope(k, cos, sin, interleave=rope_interleave)  # rope on the first Dr dims


class IndexerQueries(NamedTuple):
    """Indexer queries ``q`` and per-head weights ``w`` (``Hi ** -0.5``
    included) of the new tokens."""

    q: Float[Tensor, "T Hi Di"]
    w: Float[Tensor, "T Hi"]


def indexer_queries(
    weights: IndexerWeights,
    q_resid: Float[Tensor, "T Rq"],
    hidden: Float[Tensor, "T Dm"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    *,
    rope_interleave: bool,
) -> IndexerQueries:
    """Indexer queries from the MLA q latent ``q_resid`` (after
    ``q_a_layernorm``) and head weights from the layer input ``hidden``."""
    expect_float("q_resid", q_resid)
    expect_shape("q_resid", q_resid, (None, weights.q_lora_rank))
    T = q_resid.shape[0]
    expect_shape("hidden", hidden, (T, weights.hidden_size))
    Hi, Di = weights.n_heads, weights.head_dim
    q = row_linear(q_resid, weights.wq_b).reshape(T, Hi, Di)  # [T, Hi, Di]
    q = apply_rope(q, cos, sin, interleave=rope_interleave)  # rope on the first Dr dims
    w = row_linear(hidden.to(weights.weights_proj.dtype), weights.weights_proj).to(torch.float32) * Hi**-0.5  # [T, Hi]
    return IndexerQueries(q, w)


# --------------------------------------------------------------------------- #
# GLM-5 top-k sharing across layers
# --------------------------------------------------------------------------- #


def glm_indexer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Per-layer indexer mode of a ``glm_moe_dsa`` config dict, as
    ``transformers`` derives it: ``"full"`` runs the layer's own indexer,
    ``"shared"`` reuses the top-k of the closest earlier ``"full"`` layer.

    Read in order: ``indexer_types`` (list); ``index_topk_pattern`` (a string
    of ``F``/``S`` or a list of modes); otherwise layer ``i`` is full iff
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``
    (defaults 2 and 1: every layer full). Needs ``num_hidden_layers`` unless
    the list is given.
    """
    types = config.get("indexer_types")
    if types is None:
        pattern = config.get("index_topk_pattern")
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(f"index_topk_pattern: expected only 'F' and 'S', got {pattern!r}")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif pattern is not None:
            types = list(pattern)
        else:
            if "num_hidden_layers" not in config:
                raise ValueError("config: expected num_hidden_layers to derive the indexer types")
            freq = max(config.get("index_topk_freq", 1), 1)
            offset = config.get("index_skip_topk_offset", 2)
            types = [
                "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                for i in range(config["num_hidden_layers"])
            ]
    types = tuple(types)
    bad = sorted({t for t in types if t not in ("full", "shared")})
    if bad:
        raise ValueError(f"indexer_types: expected 'full' or 'shared' per layer, got {bad}")
    return types


def topk_source_layers(indexer_types: Sequence[str]) -> tuple[int, ...]:
    """For each layer, the layer whose top-k it attends with: itself when
    ``"full"``, else the closest earlier ``"full"`` layer."""
    sources: list[int] = []
    last_full: int | None = None
    for layer, mode in enumerate(indexer_types):
        if mode == "full":
            last_full = layer
        elif mode != "shared":
            raise ValueError(f"indexer_types: expected 'full' or 'shared' at layer {layer}, got {mode!r}")
        elif last_full is None:
            raise ValueError(f"indexer_types: shared layer {layer} has no earlier full layer to reuse")
        sources.append(last_full)
    return tuple(sources)


# --------------------------------------------------------------------------- #
# The block
# --------------------------------------------------------------------------- #


class DSALayerResult(NamedTuple):
    """What ``dsa_layer`` returns for the new tokens of one request.

    ``latent_rows`` and ``index_key_rows`` are the cache rows to append
    (``index_key_rows`` is ``None`` for a layer without its own indexer).
    ``topk`` is the selection the layer attended with, which later shared
    layers reuse.
    """

    output: Float[Tensor, "T Dm"]
    latent_rows: Float[Tensor, "T Dlat"]
    index_key_rows: Float[Tensor, "T Di"] | None
    topk: Int[Tensor, "T topk"]
    lse: Float[Tensor, "T H"]


def dsa_layer(
    weights: MLAWeights,
    indexer: IndexerWeights | None,
    hidden: Float[Tensor, "T Dm"],
    cos: Float[Tensor, "T Dr"],
    sin: Float[Tensor, "T Dr"],
    cached_latent: Float[Tensor, "Nc Dlat"],
    cached_index_keys: Float[Tensor, "Nc Di"] | None,
    *,
    scale: float,
    index_topk: int | None = None,
    indexer_rope_interleave: bool | None = None,
    shared_topk: Int[Tensor, "T topk"] | None = None,
    rope_interleave: bool = True,
    form: AttentionForm = "absorbed",
) -> DSALayerResult:
    """The attention block of DeepSeek-V3.2 / GLM-5 for one request's new tokens.

    MLA as in ``mla_layer``, restricted per query to the indexer's top-k.
    Either give ``indexer`` (with ``cached_index_keys``, ``index_topk`` and
    ``indexer_rope_interleave``, see ``INDEXER_ROPE_INTERLEAVE``) or, for a
    GLM-5 ``"shared"`` layer, ``indexer=None`` and the ``shared_topk`` returned
    by the source layer for the same tokens.
    """
    projection = mla_project(weights, hidden, cos, sin, rope_interleave=rope_interleave)
    T, N = hidden.shape[0], cached_latent.shape[0] + hidden.shape[0]
    index_key_rows = None
    if indexer is not None:
        if shared_topk is not None:
            raise ValueError("shared_topk: expected None when the layer runs its own indexer")
        if cached_index_keys is None:
            raise ValueError("cached_index_keys: expected [Nc, Di] keys when the layer has an indexer")
        if index_topk is None or indexer_rope_interleave is None:
            raise ValueError("index_topk / indexer_rope_interleave: required when the layer has an indexer")
        if projection.q_resid is None:
            raise ValueError("weights: the DSA indexer needs the q_lora path (q_a_proj / q_b_proj)")
        expect_shape("cached_index_keys", cached_index_keys, (cached_latent.shape[0], indexer.head_dim))
        interleave = indexer_rope_interleave
        index_key_rows = indexer_keys(indexer, hidden, cos, sin, rope_interleave=interleave)
        if cached_index_keys.dtype != index_key_rows.dtype:
            raise ValueError(f"cached_index_keys: expected dtype {index_key_rows.dtype}, got {cached_index_keys.dtype}")
        keys = torch.cat((cached_index_keys, index_key_rows), dim=0)
        queries = indexer_queries(indexer, projection.q_resid, hidden, cos, sin, rope_interleave=interleave)
        scores = indexer_scores(queries.q, queries.w, keys)
        selected = topk_indices(scores, n_cached=cached_latent.shape[0], topk=index_topk)
    else:
        if shared_topk is None:
            raise ValueError("shared_topk: required when the layer has no indexer (GLM-5 shared layer)")
        if cached_index_keys is not None:
            raise ValueError("cached_index_keys: expected None for a layer without an indexer")
        expect_shape("shared_topk", shared_topk, (T, None))
        selected = shared_topk
    allowed = topk_mask(selected, n_keys=N)
    result = attend_and_project(weights, projection, cached_latent, scale=scale, allowed=allowed, form=form)
    return DSALayerResult(result.output, result.latent_rows, index_key_rows, selected, result.lse)
