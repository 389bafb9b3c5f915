"""A tiny GQA decoder (Llama / Qwen3 style) with random weights.

It exists to drive the functional core end to end: `step` runs one step of
any phase through an `AttentionSession` and returns ``(logits, deltas)``; the
caller applies the deltas. Byte-level vocabulary, so any text is a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import Batch, FullAttentionConfig, FullAttentionInputs, LayerSpec, StepDeltas
from fnattn.checks import checked, fail

from .common import apply_rope, check_step_tokens, check_tokens, logit_rows, rms_norm, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    sliding_window: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                fail("TinyConfig", name, "a positive int", v)


def layer_specs(cfg: TinyConfig) -> tuple[LayerSpec, ...]:
    attn = FullAttentionConfig(num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                               sliding_window=cfg.sliding_window)
    return tuple(LayerSpec(index=i, config=attn, dtype=cfg.dtype) for i in range(cfg.num_layers))


def init_params(cfg: TinyConfig, *, seed: int = 0, device: str | torch.device = "cpu") -> dict:
    """Random weights, scaled so activations stay O(1) through the layers."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device=device, dtype=cfg.dtype)

    def ones(n):
        return torch.ones(n, dtype=cfg.dtype, device=device)

    hq, hkv, d, h = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    layers = [
        {
            "attn_norm": ones(h), "q": w(hq * d, h), "k": w(hkv * d, h), "v": w(hkv * d, h), "o": w(h, hq * d),
            "q_norm": ones(d), "k_norm": ones(d), "mlp_norm": ones(h),
            "gate": w(cfg.intermediate_size, h), "up": w(cfg.intermediate_size, h), "down": w(h, cfg.intermediate_size),
        }
        for _ in range(cfg.num_layers)
    ]
    return {"config": cfg, "embed": w(cfg.vocab_size, h) * h**0.5, "layers": layers, "norm": ones(h),
            "lm_head": w(cfg.vocab_size, h)}


def _rope(cfg: TinyConfig, batch: Batch) -> tuple[Float[Tensor, "T D"], Float[Tensor, "T D"]]:
    """Rotate-half rope over the whole head, fp32 tables at the batch's positions."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=batch.positions.device)
    return rope_cos_sin(batch.positions, inv_freq)


@checked
def step(params: dict, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits, deltas)``."""
    logits, _, deltas = step_hidden(params, session, tokens)
    return logits, deltas


def step_hidden(params: dict, session, tokens: Int[Tensor, " T"]):
    """`step` that also returns the final-norm hidden states ``[T, hidden]`` (what a draft model reads)."""
    cfg: TinyConfig = params["config"]
    batch: Batch = session.batch
    check_step_tokens("tiny.step", batch, tokens, cfg.vocab_size)
    T, hq, hkv, d = tokens.shape[0], cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = _rope(cfg, batch)  # [T, head_dim]
    x = params["embed"][tokens]  # [T, hidden]
    layer_deltas = []
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
        q = rms_norm((h @ p["q"].T).view(T, hq, d), p["q_norm"], cfg.rms_eps)
        k = rms_norm((h @ p["k"].T).view(T, hkv, d), p["k_norm"], cfg.rms_eps)
        v = (h @ p["v"].T).view(T, hkv, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, deltas = session.forward(i, FullAttentionInputs(q=q, k=k, v=v))
        layer_deltas.append(deltas)
        x = x + out.o.reshape(T, hq * d) @ p["o"].T
        h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
        x = x + (torch.nn.functional.silu(h @ p["gate"].T) * (h @ p["up"].T)) @ p["down"].T
    hidden = rms_norm(x, params["norm"], cfg.rms_eps)
    logits = logit_rows(batch, hidden) @ params["lm_head"].T
    # The cursor advances once, after every layer has read the state.
    return logits.float(), hidden, StepDeltas.collect(batch, layer_deltas)


def manifest(cfg: TinyConfig, *, hidden: bool = False, hidden_in: bool = False):
    """The lanes of a captured step (`fnattn.lanes`): no lane beyond the tokens, the batch and the outputs;
    ``hidden_in`` (with ``hidden``): the draft's step (`draft_step`), which also reads a hidden state a token."""
    from fnattn.lanes import step_manifest

    return step_manifest(vocab=cfg.vocab_size, hidden=cfg.hidden_size if hidden else None, hidden_dtype=cfg.dtype,
                         hidden_in=hidden_in)


def draft_specs(cfg: TinyConfig) -> tuple[LayerSpec, ...]:
    """The draft's one attention layer, indexed after the target's layers (it lives in its own State)."""
    attn = layer_specs(cfg)[0].config
    return (LayerSpec(index=cfg.num_layers, config=attn, dtype=cfg.dtype),)


def init_draft(cfg: TinyConfig, target: dict, *, seed: int = 1) -> dict:
    """A depth-1 multi-token-prediction head: embeddings and lm_head shared with the target."""
    layer = init_params(replace(cfg, num_layers=1), seed=seed, device=target["embed"].device)["layers"][0]
    g = torch.Generator().manual_seed(seed + 1)
    h = cfg.hidden_size
    fc = (torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5).to(target["embed"])
    return {"config": cfg, "target": target, "layer": layer, "fc": fc}


def draft_step(params: dict, session, tokens: Int[Tensor, " T"], hidden: Float[Tensor, "T D"]):
    """Position p reads the target's hidden state at p and token p + 1; predicts token p + 2.

    ``-> (logits [T, vocab], hidden_out [T, D], StepDeltas)``.
    """
    cfg: TinyConfig = params["config"]
    target, p = params["target"], params["layer"]
    batch = session.batch
    check_tokens("tiny.draft_step", tokens, cfg.vocab_size)
    T, hq, hkv, d = tokens.shape[0], cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = _rope(cfg, batch)  # [T, head_dim]
    e = rms_norm(target["embed"][tokens], target["norm"], cfg.rms_eps)
    x = torch.cat([e, rms_norm(hidden, target["norm"], cfg.rms_eps)], dim=-1) @ params["fc"].T
    h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
    q = rms_norm((h @ p["q"].T).view(T, hq, d), p["q_norm"], cfg.rms_eps)
    k = rms_norm((h @ p["k"].T).view(T, hkv, d), p["k_norm"], cfg.rms_eps)
    v = (h @ p["v"].T).view(T, hkv, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, deltas = session.forward(cfg.num_layers, FullAttentionInputs(q=q, k=k, v=v))
    x = x + out.o.reshape(T, hq * d) @ p["o"].T
    h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
    x = x + (torch.nn.functional.silu(h @ p["gate"].T) * (h @ p["up"].T)) @ p["down"].T
    hidden_out = rms_norm(x, target["norm"], cfg.rms_eps)
    logits = (logit_rows(batch, hidden_out) @ target["lm_head"].T).float()
    return logits, hidden_out, StepDeltas.collect(batch, [deltas])
