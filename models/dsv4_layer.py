"""DeepSeek-V4 attention layer, model side: projections, norms, rope, compressor gates, grouped output.

What transformers' ``DeepseekV4Attention`` does around the attention itself:
q through a low-rank path (``q_a_proj``, ``q_a_norm``, ``q_b_proj``, an
unweighted per-head norm), one shared K=V head (``kv_proj``, ``kv_norm``),
the interleaved rope on each head's trailing ``qk_rope_head_dim`` dims, the
compressors' raw projections with their position bias, the indexer's queries
and weights (CSA), and after the attention the inverse rope of the output and
the grouped output projection (``o_a_proj`` per group of heads, then
``o_b_proj``). The kind (`fnattn.kinds.dsv4`) owns the compressors' pooling
and state, the indexer's top-k and the attention with sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from fnattn.kernels.invariant import pointwise
from fnattn.kinds.dsv4 import DSV4Config, DSV4Inputs
from fnattn.kinds.dsv4.math import mean_squares, rms_norm_fp32w, rope_tail

from .mla_layer import pad_heads
from .norm_rope import row_linear


@dataclass(frozen=True, eq=False)
class Compressor:
    kv_proj: Tensor  # [overlap * D, hidden]
    gate_proj: Tensor  # [overlap * D, hidden]
    position_bias: Tensor  # [ratio, overlap * D] fp32
    norm: Tensor  # [D] fp32

    @classmethod
    def take(cls, w, p: str) -> Compressor:
        return cls(w[p + "wkv.weight"], w[p + "wgate.weight"], w[p + "ape"].float(), w[p + "norm.weight"].float())

    @staticmethod
    def shapes(p: str, hidden: int, D: int, ratio: int, overlap: int) -> dict[str, tuple[int, ...]]:
        return {p + "ape": (ratio, overlap * D), p + "wkv.weight": (overlap * D, hidden),
                p + "wgate.weight": (overlap * D, hidden), p + "norm.weight": (D,)}

    def rows(self, h: Tensor, positions: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
        """``(kv [T, cD], gate + position bias [T, cD] fp32)`` of this step's tokens."""
        gate = row_linear(h, self.gate_proj) + self.position_bias.index_select(0, positions.remainder(ratio))
        return row_linear(h, self.kv_proj), gate.float()


@dataclass(frozen=True, eq=False)
class AttnWeights:
    q_a: Tensor  # [q_lora, hidden]
    q_a_norm: Tensor  # [q_lora] fp32
    q_b: Tensor  # [H * D, q_lora]
    kv: Tensor  # [D, hidden]
    kv_norm: Tensor  # [D] fp32
    o_a: Tensor  # [groups * o_lora, H * D / groups]
    o_b: Tensor  # [hidden, groups * o_lora]
    sinks: Tensor  # [H] fp32
    compressor: Compressor | None
    indexer: Compressor | None  # CSA: the indexer's own compressor
    index_q_b: Tensor | None  # [Hi * Di, q_lora]
    index_weights: Tensor | None  # [Hi, hidden]

    @classmethod
    def take(cls, w, p: str, c: DSV4Config) -> AttnWeights:
        """From the checkpoint names under ``p`` (``model.layers.{i}.attn.``, DeepSeek's own naming)."""
        comp = ix = qb = iw = None
        if c.compress_ratio:
            comp = Compressor.take(w, p + "compressor.")
        if c.indexer is not None:
            x = p + "indexer."
            ix, qb, iw = Compressor.take(w, x + "compressor."), w[x + "wq_b.weight"], w[x + "weights_proj.weight"]
        return cls(w[p + "wq_a.weight"], w[p + "q_norm.weight"].float(), w[p + "wq_b.weight"], w[p + "wkv.weight"],
                   w[p + "norm.weight"].float(), w[p + "wo_a.weight"], w[p + "wo_b.weight"],
                   w[p + "attn_sink"].float(), comp, ix, qb, iw)

    @staticmethod
    def shapes(p: str, c: DSV4Config, *, hidden: int, q_lora_rank: int, o_groups: int, o_lora_rank: int
               ) -> dict[str, tuple[int, ...]]:
        H, D = c.num_heads, c.head_dim
        s = {p + "attn_sink": (H,), p + "wq_a.weight": (q_lora_rank, hidden), p + "q_norm.weight": (q_lora_rank,),
             p + "wq_b.weight": (H * D, q_lora_rank), p + "wkv.weight": (D, hidden), p + "norm.weight": (D,),
             p + "wo_a.weight": (o_groups * o_lora_rank, H * D // o_groups),
             p + "wo_b.weight": (hidden, o_groups * o_lora_rank)}
        if c.compress_ratio:
            s.update(Compressor.shapes(p + "compressor.", hidden, D, c.compress_ratio, c.overlap))
        if c.indexer is not None:
            x, Hi, Di = p + "indexer.", c.indexer.num_heads, c.indexer.head_dim
            s.update(Compressor.shapes(x + "compressor.", hidden, Di, c.compress_ratio, 2))
            s.update({x + "wq_b.weight": (Hi * Di, q_lora_rank), x + "weights_proj.weight": (Hi, hidden)})
        return s


def unweighted_norm(x: Tensor, eps: float) -> Tensor:
    """The per-head q norm without a weight; the fp32 factor is rounded to ``x.dtype`` before the product. Its
    statistics are `mean_squares`' (in the invariant mode on CUDA each row summed alone in one order)."""
    return x * torch.rsqrt(mean_squares(x.float()) + eps).to(x.dtype)


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Half-size ``(cos, sin)`` ``[T, Dr / 2]`` at ``positions``, in ``dtype`` (as transformers casts them)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = pointwise(lambda f: (f.cos(), f.sin()), freqs)
    return cos.to(dtype), sin.to(dtype)


def attention_inputs(w: AttnWeights, c: DSV4Config, h: Float[Tensor, "T hidden"], positions: Tensor,
                     cos: Tensor, sin: Tensor, comp_inv_freq: Tensor | None, eps: float) -> DSV4Inputs:
    """The layer's `DSV4Inputs` from its normalised input ``h`` (``cos``/``sin``: this layer's rope)."""
    T, H, D = h.shape[0], c.num_heads, c.head_dim
    q_res = rms_norm_fp32w(row_linear(h, w.q_a), w.q_a_norm, eps)  # [T, q_lora]
    q = unweighted_norm(row_linear(q_res, w.q_b).view(T, H, D), eps)
    q = rope_tail(q, cos, sin)
    kv = rope_tail(rms_norm_fp32w(row_linear(h, w.kv), w.kv_norm, eps), cos, sin)  # [T, D]
    extra = {}
    if w.compressor is not None:
        ckv, cgate = w.compressor.rows(h, positions, c.compress_ratio)
        extra.update(comp_kv=ckv, comp_gate=cgate, comp_norm=w.compressor.norm, comp_inv_freq=comp_inv_freq)
    if w.indexer is not None:
        ix = c.indexer
        ikv, igate = w.indexer.rows(h, positions, c.compress_ratio)
        iq = rope_tail(row_linear(q_res, w.index_q_b).view(T, ix.num_heads, ix.head_dim), cos, sin)
        iw = row_linear(h, w.index_weights).float() * ix.num_heads ** -0.5
        extra.update(index_q=iq, index_w=iw, index_kv=ikv, index_gate=igate, index_norm=w.indexer.norm)
    # Heads the kernels need beyond the model's: zero queries, and sinks that take no weight (-inf).
    q = pad_heads(q, c.heads)
    sinks = F.pad(w.sinks, (0, c.heads - H), value=float("-inf")) if c.sinks and c.heads > H else w.sinks
    return DSV4Inputs(q=q, kv=kv, sinks=sinks if c.sinks else None, **extra)


def output_projection(w: AttnWeights, o: Float[Tensor, "T H D"], cos: Tensor, sin: Tensor, o_groups: int
                      ) -> Float[Tensor, "T hidden"]:
    """Undo the rope the values carried (K = V), then the grouped low-rank output projection."""
    T = o.shape[0]
    o = rope_tail(o, cos, -sin)
    g = o.reshape(T, o_groups, -1).transpose(0, 1)  # [G, T, H * D / G]
    wa = w.o_a.view(o_groups, -1, g.shape[-1]).transpose(1, 2)  # [G, H * D / G, o_lora]
    y = torch.bmm(g, wa).transpose(0, 1).reshape(T, -1)  # [T, G * o_lora]
    return row_linear(y, w.o_b)
