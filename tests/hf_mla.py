"""Tiny random-weight Hugging Face MLA / DSA attention modules, shared by the
MLA and DSA tests: DeepseekV3Attention, DeepSeek-V3.2 attention + indexer and
GLM-MoE-DSA's full + shared layer pair, and a step-by-step runner over a
``DynamicCache``."""

from __future__ import annotations

import contextlib
from collections import namedtuple

import torch
from fnattn.kernels.indexer import ordered_topk
from fnattn.models.dsa_layer import IndexerWeights
from fnattn.models.mla_layer import MLAWeights
from transformers import DeepseekV3Config, DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

H, Dn, Dr, Dv, R, Rq, Dm = 4, 16, 8, 16, 32, 24, 64
Hi, Di, TOPK = 2, 16, 4

COMMON = dict(
    hidden_size=Dm,
    num_attention_heads=H,
    num_key_value_heads=H,
    kv_lora_rank=R,
    q_lora_rank=Rq,
    qk_nope_head_dim=Dn,
    qk_rope_head_dim=Dr,
    v_head_dim=Dv,
    intermediate_size=32,
    moe_intermediate_size=16,
    n_routed_experts=4,
    vocab_size=32,
    max_position_embeddings=128,
    index_n_heads=Hi,
    index_head_dim=Di,
    index_topk=TOPK,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
    "beta_fast": 32,
    "beta_slow": 1,
}


# --------------------------------------------------------------------------- #
# configs and modules
# --------------------------------------------------------------------------- #


def tiny_config(*, q_lora_rank=Rq, rope_interleave=True, attention_bias=False, rope_parameters=None):
    """DeepSeek-V3 (dense MLA)."""
    config = DeepseekV3Config(
        hidden_size=Dm,
        num_attention_heads=H,
        num_key_value_heads=H,
        kv_lora_rank=R,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=Dn,
        qk_rope_head_dim=Dr,
        v_head_dim=Dv,
        num_hidden_layers=1,
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        vocab_size=32,
        max_position_embeddings=128,
        rope_interleave=rope_interleave,
        attention_bias=attention_bias,
        rope_parameters=rope_parameters,
    )
    config._attn_implementation = "eager"
    return config


def v32_config():
    config = DeepseekV32Config(num_hidden_layers=1, **COMMON)
    config._attn_implementation = "eager"
    return config


def glm_config():
    config = GlmMoeDsaConfig(num_hidden_layers=2, indexer_types=["full", "shared"], **COMMON)
    config._attn_implementation = "eager"
    return config


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, norms included (not ones / zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)


def build_hf(config, seed=0):
    """A DeepseekV3Attention with random weights and its rotary module."""
    attn = hf_v3.DeepseekV3Attention(config, layer_idx=0).eval()
    randomize_(attn, seed)
    return attn, hf_v3.DeepseekV3RotaryEmbedding(config)


def build_v32(config, seed=0):
    """A DeepSeek-V3.2 attention block (with its indexer) and its rotary module."""
    attn = hf_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    randomize_(attn, seed)
    return attn, hf_v32.DeepseekV32RotaryEmbedding(config)


def build_glm_pair(config, seeds=(0, 1)):
    """GLM-MoE-DSA layers 0 ("full", own indexer) and 1 ("shared"), and the rotary module."""
    pair = []
    for layer, seed in enumerate(seeds):
        attn = hf_glm.GlmMoeDsaAttention(config, layer_idx=layer).eval()
        randomize_(attn, seed)
        pair.append(attn)
    return tuple(pair), hf_glm.GlmMoeDsaRotaryEmbedding(config)


def weights_of(attn):
    """``(MLAWeights, IndexerWeights | None)`` of one HF attention module."""
    sd = attn.state_dict()
    indexer = IndexerWeights.from_state_dict(sd) if getattr(attn, "indexer", None) is not None else None
    return MLAWeights.from_state_dict(sd), indexer


# --------------------------------------------------------------------------- #
# running HF step by step
# --------------------------------------------------------------------------- #


def causal_additive_mask(n_past: int, S: int, dtype=torch.float32) -> torch.Tensor:
    key_pos = torch.arange(n_past + S)
    blocked = key_pos[None, :] > (n_past + torch.arange(S))[:, None]
    return torch.zeros(S, n_past + S, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


def hf_step(attn, rotary, x, n_past, cache):
    """Run a DeepseekV3Attention on new tokens x [S, Dm] after n_past cached tokens."""
    S = x.shape[0]
    positions = torch.arange(n_past, n_past + S)[None]
    cos, sin = rotary(x[None], positions)
    with torch.no_grad():
        out = attn(x[None], (cos, sin), causal_additive_mask(n_past, S, x.dtype), cache=cache)[0]
    return out[0], cos[0], sin[0]


def hf_cache_rows(cache, layer: int = 0) -> torch.Tensor:
    """The latent rows ``[c_kv, k_pe]`` a DynamicCache holds for one layer."""
    entry = cache.layers[layer]
    return torch.cat((entry.keys[0, 0], entry.values[0, 0]), dim=-1)


class HFRunner:
    """Runs one HF attention module step by step, recording its indexer's top-k."""

    def __init__(self, attn, rotary, cache):
        self.attn, self.rotary, self.cache = attn, rotary, cache
        self.hf_topk = None
        if getattr(attn, "indexer", None) is not None:
            attn.indexer.register_forward_hook(lambda mod, args, out: setattr(self, "hf_topk", out[0].long()))

    def step(self, x, n_past, **kwargs):
        S = x.shape[0]
        positions = torch.arange(n_past, n_past + S)[None]
        cos, sin = self.rotary(x[None], positions)
        with torch.no_grad():
            outs = self.attn(
                x[None], (cos, sin), causal_additive_mask(n_past, S, x.dtype), cache=self.cache,
                position_ids=positions, **kwargs
            )
        return outs, cos[0], sin[0]


def assert_same_selection(ours: torch.Tensor, hf: torch.Tensor, n_past: int) -> None:
    """HF picks min(topk, N) keys including masked ones when fewer are visible;
    compare the visible picks as sets. With 2 indexer heads many scores are
    exactly 0 (every head's ReLU is 0); ours gives such ties to the earlier
    position (`ordered_topk`), so the HF side must run with the same rule
    where a tie falls at the cut-off (`ties_to_earlier` below)."""
    for i in range(ours.shape[0]):
        hf_set = {j for j in hf[i].tolist() if j <= n_past + i}
        ours_set = {j for j in ours[i].tolist() if j >= 0}
        assert ours_set == hf_set, (i, ours[i].tolist(), hf[i].tolist())


_TopK = namedtuple("_TopK", "values indices")


def _topk_earlier(self, k, dim=-1, largest=True, sorted=True):
    assert largest and dim in (-1, self.dim() - 1), "the indexers select the largest scores of the last dim"
    if self.numel() == 0 or k == 0:  # nothing to rank (no entry yet): an empty selection of the asked shape
        return _TopK(self.new_empty(*self.shape[:-1], k), self.new_empty(*self.shape[:-1], k, dtype=torch.long))
    idx = ordered_topk(self.reshape(-1, self.shape[-1]), k).view(*self.shape[:-1], k)
    return _TopK(self.gather(-1, idx), idx)


@contextlib.contextmanager
def ties_to_earlier():
    """Within this block transformers' indexers (and only they: not the MoE routers) break ties of their
    top-k toward the earlier position, as fnattn does."""
    saved = {cls: cls.forward for cls in (DeepseekV4Indexer, hf_v32.DeepseekV32Indexer, hf_glm.GlmMoeDsaIndexer)}

    def wrap(forward):
        def forward_with_ordered_ties(*args, **kwargs):
            plain = torch.Tensor.topk
            torch.Tensor.topk = _topk_earlier
            try:
                return forward(*args, **kwargs)
            finally:
                torch.Tensor.topk = plain
        return forward_with_ordered_ties

    for cls, forward in saved.items():
        cls.forward = wrap(forward)
    try:
        yield
    finally:
        for cls, forward in saved.items():
            cls.forward = forward
