"""Per-kind layer inputs and outputs passed through a session to a backend.

Callers fill the activations; the session fills ``meta`` (the step's batch and
the group's plan) before the backend sees them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from jaxtyping import Float
from torch import Tensor

from .checks import fail


@dataclass(frozen=True)
class StepMeta:
    batch: Any  # the step's Batch
    plan: Any = None  # the backend's plan for this layer's group, if it makes one
    workspace: Any = None  # the session's workspace lease


def _output_pytree(cls):
    """Register an output dataclass with optree (namespace fnattn): every field is a child.

    `fnattn.probe` flattens outputs with optree; without this an output would be one
    opaque leaf and only the deltas would be compared. Non-tensor children (verify's
    ``replay`` inputs) stay leaves of their own.
    """
    names = tuple(f.name for f in dataclasses.fields(cls))
    optree.register_pytree_node(
        cls,
        lambda out: (tuple(getattr(out, n) for n in names), None, names),
        lambda _, children: cls(**dict(zip(names, children))),
        namespace="fnattn",
    )
    return cls


def _check(where: str, name: str, t: Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(t, Tensor):
        fail(where, name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != shape:
        fail(where, name, f"shape {shape}", tuple(t.shape))
    if t.dtype != dtype:
        fail(where, name, f"dtype {dtype}", t.dtype)
    if t.device != device:
        fail(where, name, f"a tensor on {device}", t.device)


@dataclass(frozen=True)
class FullAttentionInputs:
    q: Float[Tensor, "T Hq D"]  # [T, Hq, D], rope applied
    k: Float[Tensor, "T Hkv D"]  # [T, Hkv, D], rope applied
    v: Float[Tensor, "T Hkv Dv"]  # [T, Hkv, Dv]
    sinks: Float[Tensor, " Hq"] | None = None  # [Hq] sink logits when the config has sinks
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        _check(where, "q", self.q, (T, c.num_q_heads, c.head_dim), spec.dtype, device)
        _check(where, "k", self.k, (T, c.num_kv_heads, c.head_dim), spec.dtype, device)
        _check(where, "v", self.v, (T, c.num_kv_heads, c.head_dim_v), spec.dtype, device)
        if c.sinks:
            if self.sinks is None:
                fail(where, "sinks", f"a [{c.num_q_heads}] tensor (config has sinks=True)", None)
            _check(where, "sinks", self.sinks, (c.num_q_heads,), self.sinks.dtype, device)
        elif self.sinks is not None:
            fail(where, "sinks", "None (config has sinks=False)", tuple(self.sinks.shape))


@_output_pytree
@dataclass(frozen=True)
class AttentionOutput:
    o: Float[Tensor, "T Hq Dv"]  # [T, Hq, Dv] in the layer dtype
    lse: Float[Tensor, "T Hq"] | None = None  # [T, Hq] fp32 natural-log LSE, without sinks


@dataclass(frozen=True)
class RecurrentInputs:
    """Gated DeltaNet / Kimi Delta Attention: the conv input and the gates of this step.

    The backend owns the causal conv (its window is state), the split into
    q/k/v, the l2 norm of q and k, and the recurrence. Projections, the output
    norm and gate stay with the model.
    """

    x: Float[Tensor, "T C"]  # [T, C] conv input: q | k | v channels, before the causal conv
    conv_weight: Float[Tensor, "C W"]  # [C, W] depthwise conv taps
    g: Float[Tensor, "T H *K"]  # [T, H] (GDN, scalar) or [T, H, K] (KDA, per channel) log decay, fp32
    beta: Float[Tensor, "T H"]  # [T, H] delta-rule step size, after the sigmoid
    conv_bias: Float[Tensor, " C"] | None = None  # [C]
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        H = c.num_v_heads if spec.kind == "gdn" else c.num_heads
        _check(where, "x", self.x, (T, c.conv_dim), spec.dtype, device)
        _check(where, "conv_weight", self.conv_weight, (c.conv_dim, c.conv_kernel), spec.dtype, device)
        if self.conv_bias is not None:
            _check(where, "conv_bias", self.conv_bias, (c.conv_dim,), spec.dtype, device)
        g_shape = (T, H) if spec.kind == "gdn" else (T, H, c.head_k_dim)
        _check(where, "g", self.g, g_shape, torch.float32, device)
        beta_dtype = self.beta.dtype if self.beta.dtype in (spec.dtype, torch.float32) else spec.dtype
        _check(where, "beta", self.beta, (T, H), beta_dtype, device)


@_output_pytree
@dataclass(frozen=True)
class RecurrentOutput:
    o: Float[Tensor, "T H V"]  # [T, H, V] in the layer dtype, before the output norm
    # Verify only: the step's own inputs, kept so accepted tokens can be replayed
    # from the pre-step state instead of keeping a state per draft position.
    replay: RecurrentInputs | None = None


@dataclass(frozen=True)
class MLAInputs:
    """DeepSeek-V3 multi-head latent attention, after projections and rope."""

    q_nope: Float[Tensor, "T H Dn"]  # [T, H, Dn]
    q_pe: Float[Tensor, "T H Dr"]  # [T, H, Dr], rope applied
    latent: Float[Tensor, "T RDr"]  # [T, R + Dr] new cache rows: normalized c_kv, then roped k_pe
    w_uk: Float[Tensor, "H Dn R"]  # [H, Dn, R] key half of kv_b_proj
    w_uv: Float[Tensor, "H Dv R"]  # [H, Dv, R] value half of kv_b_proj
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        T, where = batch.num_tokens, f"layer {spec.index} inputs"
        if spec.kind not in ("mla", "sparse_mla"):
            fail(where, "inputs", f"the inputs of a {spec.kind!r} layer", type(self).__name__)
        if spec.kind == "sparse_mla" and not isinstance(self, SparseMLAInputs):
            fail(where, "inputs", "SparseMLAInputs (the layer is sparse_mla)", type(self).__name__)
        m = spec.config if spec.kind == "mla" else spec.config.mla
        H, R = m.num_heads, m.kv_lora_rank
        _check(where, "q_nope", self.q_nope, (T, H, m.qk_nope_head_dim), spec.dtype, device)
        _check(where, "q_pe", self.q_pe, (T, H, m.qk_rope_head_dim), spec.dtype, device)
        _check(where, "latent", self.latent, (T, m.latent_dim), spec.dtype, device)
        _check(where, "w_uk", self.w_uk, (H, m.qk_nope_head_dim, R), spec.dtype, device)
        _check(where, "w_uv", self.w_uv, (H, m.v_head_dim, R), spec.dtype, device)


@dataclass(frozen=True)
class SparseQueryMetadata:
    """Per-step metadata shared by every sparse layer of a model; built once per step."""

    topk: int  # tokens each query attends
    request_of_token: Tensor  # [T] int64: which request (batch row) each new token belongs to
    visible_keys: Tensor  # [T] int64: keys a token may select (its position + 1: causal, itself included)

    @staticmethod
    def build(batch, *, topk: int) -> "SparseQueryMetadata":
        if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
            fail("SparseQueryMetadata", "topk", "a positive int", topk)
        rows = torch.repeat_interleave(torch.arange(batch.num_requests, device=batch.positions.device),
                                       torch.tensor(batch.host_new_lens, device=batch.positions.device))
        return SparseQueryMetadata(topk=topk, request_of_token=rows, visible_keys=batch.positions + 1)


@dataclass(frozen=True)
class SparseMLAInputs(MLAInputs):
    """MLA plus the DSA indexer's query side; a layer either scores or reuses indices."""

    sparse: SparseQueryMetadata | None = None
    index_q: Float[Tensor, "T Hi Di"] | None = None  # [T, Hi, Di] indexer queries, rope applied
    index_w: Float[Tensor, "T Hi"] | None = None  # [T, Hi] per-head indexer weights (scales folded in)
    index_k: Float[Tensor, "T Di"] | None = None  # [T, Di] this step's new indexer keys
    topk_indices: Tensor | None = None  # [T, topk] int64 positions chosen by the source layer (-1: none)

    def validate(self, spec, batch, device) -> None:
        super().validate(spec, batch, device)
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        if not isinstance(self.sparse, SparseQueryMetadata):
            fail(where, "sparse", "the step's SparseQueryMetadata", type(self.sparse).__name__)
        _check(where, "sparse.visible_keys", self.sparse.visible_keys, (T,), torch.int64, device)
        if c.index_source_layer is None:
            ix = c.indexer
            _check(where, "index_q", self.index_q, (T, ix.num_heads, ix.head_dim), spec.dtype, device)
            w_dtype = self.index_w.dtype if isinstance(self.index_w, Tensor) else spec.dtype
            _check(where, "index_w", self.index_w, (T, ix.num_heads), w_dtype, device)
            if not w_dtype.is_floating_point:
                fail(where, "index_w", "a floating-point tensor", w_dtype)
            _check(where, "index_k", self.index_k, (T, ix.head_dim), spec.dtype, device)
            if self.topk_indices is not None:
                fail(where, "topk_indices", "None (this layer runs its own indexer)", tuple(self.topk_indices.shape))
        else:
            _check(where, "topk_indices", self.topk_indices, (T, self.sparse.topk), torch.int64, device)
            # A layer that reuses another layer's top-k has no indexer: indexer
            # inputs given to it are a wiring mistake, not something to ignore.
            for name in ("index_q", "index_w", "index_k"):
                if getattr(self, name) is not None:
                    fail(where, name, f"None (this layer reuses layer {c.index_source_layer}'s top-k)",
                         tuple(getattr(self, name).shape))


@_output_pytree
@dataclass(frozen=True)
class SparseAttentionOutput:
    o: Float[Tensor, "T H Dv"]  # [T, H, Dv]
    lse: Float[Tensor, "T H"] | None  # [T, H]
    topk_indices: Tensor  # [T, topk] int64 positions attended (-1: padding); reusable by later layers


#: The inputs class each kind's backends take.
INPUTS_BY_KIND = {"full": FullAttentionInputs, "mla": MLAInputs, "sparse_mla": SparseMLAInputs,
                  "gdn": RecurrentInputs, "kda": RecurrentInputs}
