"""transformers' recurrent attention modules from tiny configs, as peer oracles.

Qwen3.5 / Qwen3-Next Gated DeltaNet and Kimi Linear's KDA, forced onto their
pure-torch code path (with fla / causal_conv1d installed the module-level
names may point at GPU kernels), a runner that feeds chunks of one request
through a module with its cache, and `LayerPair`: one such module next to
our side of it (weights, spec, the projections before a session and the
output norm after it).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from fnattn.models.gdn_layer import GDNWeights, gdn_finish, gdn_project
from fnattn.models.kda_layer import KDAWeights, kda_finish, kda_project

import fnattn as fa

GDN_SIZES = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    vocab_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
KDA_SIZES = dict(
    hidden_size=64,
    linear_num_heads=2,
    linear_head_dim=32,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    vocab_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
)
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
_GDN_TORCH_PATH = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
_KDA_TORCH_PATH = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _torch_function(module, name):
    """The reference torch function ``module.name`` under transformers' kernel wrappers: decorators
    (``__wrapped__``) and, where the ``kernels`` package is installed (transformers >= 5.25 requires it), an
    ``nn.Module`` whose forward calls the decorated function it closes over."""
    fn = getattr(module, name)
    if isinstance(fn, torch.nn.Module):
        forward = type(fn).forward
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
        assert "func" in cells, f"{module.__name__}.{name}: a module wrapper without the function it calls"
        fn = cells["func"].cell_contents
    fn = inspect.unwrap(fn)
    assert fn.__module__ == module.__name__ and fn.__name__ == name, f"{module.__name__}.{name}: got {fn!r}"
    return fn


def _force_torch_path(mp, module, names):
    for name in names:
        mp.setattr(module, name, _torch_function(module, name))


@contextmanager
def gdn_modules():
    """Yields ``{family: (config class, module class)}`` for "qwen3_5" and "qwen3_next"."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    with pytest.MonkeyPatch.context() as mp:
        _force_torch_path(mp, modeling_qwen3_5, _GDN_TORCH_PATH)
        _force_torch_path(mp, modeling_qwen3_next, _GDN_TORCH_PATH)
        yield {
            "qwen3_5": (Qwen3_5TextConfig, modeling_qwen3_5.Qwen3_5GatedDeltaNet),
            "qwen3_next": (Qwen3NextConfig, modeling_qwen3_next.Qwen3NextGatedDeltaNet),
        }


@contextmanager
def kda_modules():
    """Yields ``(config class, module class)`` of Kimi Linear's delta attention."""
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    with pytest.MonkeyPatch.context() as mp:
        _force_torch_path(mp, modeling_kimi_linear, _KDA_TORCH_PATH)
        yield KimiLinearConfig, modeling_kimi_linear.KimiLinearDeltaAttention


def gdn_module(families, family, *, seed, dtype=torch.float32):
    """A random-weight GDN module of ``family`` and its config."""
    config_cls, module_cls = families[family]
    config = config_cls(**GDN_SIZES, **_NO_TOKENS)
    torch.manual_seed(seed)
    m = module_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.1, 1.0).log())
        m.dt_bias.normal_()
        m.norm.weight.copy_(1 + 0.1 * torch.randn_like(m.norm.weight))
    return m.to(dtype), config


def kda_module(kda, *, seed, dtype=torch.float32):
    """A random-weight KDA module and its config."""
    config_cls, module_cls = kda
    config = config_cls(**KDA_SIZES, **_NO_TOKENS)
    torch.manual_seed(seed)
    m = module_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        # A_log and dt_bias are left uninitialized by the module itself.
        m.forget_gate.A_log.copy_(torch.empty_like(m.forget_gate.A_log).uniform_(0.1, 1.0).log())
        m.forget_gate.dt_bias.normal_()
        m.o_norm.weight.copy_(1 + 0.1 * torch.randn_like(m.o_norm.weight))
    return m.to(dtype), config


def run_hf(module, config, chunks):
    """Feed the chunks ``[n_i, Dmodel]`` of one request through ``module`` with a fresh cache.

    Returns ``(outputs per chunk, conv window [C, W - 1], recurrent state [H, K, V])``.
    """
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    with torch.no_grad():
        outs = [module(c[None], cache=cache)[0] for c in chunks]
    layer = cache.layers[0]
    # transformers keeps the last W conv inputs; the window is the last W - 1 of them.
    return outs, layer.conv_states[0][0, :, 1:], layer.recurrent_states[0][0]


@dataclass
class LayerPair:
    """A transformers layer and our side of it: ``project -> session -> finish``."""

    module: torch.nn.Module
    config: object
    spec: fa.LayerSpec
    w: GDNWeights | KDAWeights

    def project(self, x):
        """Hidden states ``[T, Dmodel]`` -> (the session's RecurrentInputs, the output gate)."""
        fn = gdn_project if self.spec.kind == "gdn" else kda_project
        conv_input, gate, g, beta = fn(self.w, x)
        inputs = fa.RecurrentInputs(x=conv_input, conv_weight=self.w.conv_weight, conv_bias=self.w.conv_bias,
                                 g=g, beta=beta)
        return inputs, gate

    def finish(self, o, gate):
        return (gdn_finish if self.spec.kind == "gdn" else kda_finish)(self.w, o, gate)


def layer_pair(modules, family, *, seed, dtype=torch.float32, state_dtype=torch.float32) -> LayerPair:
    """``family``: "qwen3_5" or "qwen3_next" (``modules`` from `gdn_modules`), "kimi" (from `kda_modules`)."""
    if family == "kimi":
        m, config = kda_module(modules, seed=seed, dtype=dtype)
        w = KDAWeights.from_state_dict(m.state_dict(), eps=config.rms_norm_eps, activation=config.hidden_act)
        cfg = fa.KDAConfig(num_heads=w.num_heads, head_k_dim=w.head_k_dim, head_v_dim=w.head_v_dim,
                           conv_kernel=w.conv_kernel, state_dtype=state_dtype)
    else:
        m, config = gdn_module(modules, family, seed=seed, dtype=dtype)
        w = GDNWeights.from_state_dict(m.state_dict(), num_k_heads=config.linear_num_key_heads,
                                       eps=config.rms_norm_eps, activation=config.hidden_act)
        cfg = fa.GDNConfig(num_k_heads=w.num_k_heads, num_v_heads=w.num_v_heads, head_k_dim=w.head_k_dim,
                           head_v_dim=w.head_v_dim, conv_kernel=w.conv_kernel, state_dtype=state_dtype)
    return LayerPair(m, config, fa.LayerSpec(index=0, config=cfg, dtype=dtype), w)
