"""The Kimi Delta Attention layer of Kimi Linear as a pure function of its checkpoint weights and states.

``kda_layer`` reproduces transformers' ``KimiLinearDeltaAttention`` for one
request. It is built from three pieces a model can also call around an
attention session (projections and the output norm stay with the model; the
conv, q/k/v split and recurrence are the backend's)::

    kda_project(w, x) -> (conv_input, gate, g, beta)
    causal conv + kda_qkv(...) + gated delta rule      # the backend's part
    kda_finish(w, o, gate) -> out

In full::

    x -> q_proj, k_proj (H heads of size K), v_proj (H heads of size V)
      -> a short causal conv per projection (q, k and v each have their own
         depthwise conv and window), activation
      -> l2-normalize q and k (fp32, ``x / sqrt(sum(x^2) + eps)``)
      -> per-channel log-decay g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)
      -> beta = sigmoid(b_proj(x))
      -> gated delta rule with per-channel decay
      -> RMSNorm per head (fp32, weight in fp32) times sigmoid(g_b(g_a(x))) -> o_proj

The three convs run as one depthwise conv over ``[2 H K + H V]`` channels,
blocks q, then k, then v (``KDAWeights.conv_weight``, the layout of
transformers' fused ``conv1d`` and of ``docs/layout.md``): a depthwise conv
never mixes channels, so this is the same as three separate convs, and the
three windows are stored as one ``[2 H K + H V, W - 1]`` tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from fnattn.kernels.invariant import pointwise
from jaxtyping import Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kinds.delta_rule.conv import causal_conv1d, check_activation
from fnattn.kinds.delta_rule.math import RecurrentLayerOutput, gated_delta_chunked, gated_delta_recurrent
from fnattn.kinds.delta_rule.qkv import kda_qkv

from .common import rms_norm
from .norm_rope import row_linear

__all__ = [
    "KDAWeights",
    "RecurrentLayerOutput",
    "kda_finish",
    "kda_forget_gate",
    "kda_layer",
    "kda_project",
    "rmsnorm_sigmoid_gate",
]


@dataclass(frozen=True, eq=False)
class KDAWeights:
    """Weights of one Kimi Delta Attention layer.

    Dimensions: ``Dmodel`` hidden size, ``H`` heads with key size ``K`` (q and
    k) and value size ``V`` (v and the output), ``Rf``/``Rg`` the ranks of the
    low-rank forget-gate and output-gate projections (the head size in Kimi
    Linear), ``W`` conv kernel width.
    """

    q_proj: Float[Tensor, "HK Dmodel"]
    k_proj: Float[Tensor, "HK Dmodel"]
    v_proj: Float[Tensor, "HV Dmodel"]
    q_conv_weight: Float[Tensor, "HK W"]
    k_conv_weight: Float[Tensor, "HK W"]
    v_conv_weight: Float[Tensor, "HV W"]
    f_a_proj: Float[Tensor, "Rf Dmodel"]
    f_b_proj: Float[Tensor, "HK Rf"]
    A_log: Float[Tensor, " H"]
    dt_bias: Float[Tensor, " HK"]
    b_proj: Float[Tensor, "H Dmodel"]
    g_a_proj: Float[Tensor, "Rg Dmodel"]
    g_b_proj: Float[Tensor, "HV Rg"]
    o_norm_weight: Float[Tensor, " V"]
    o_proj: Float[Tensor, "Dmodel HV"]
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    eps: float = 1e-5
    activation: str = "silu"

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        check_activation(self.activation)
        H, HK, HV = self.num_heads, self.key_dim, self.value_dim
        expect_shape("q_proj", self.q_proj, (HK, None))
        Dm = self.q_proj.shape[1]
        expect_shape("k_proj", self.k_proj, (HK, Dm))
        expect_shape("v_proj", self.v_proj, (HV, Dm))
        expect_shape("q_conv_weight", self.q_conv_weight, (HK, None))
        W = self.q_conv_weight.shape[1]
        expect_shape("k_conv_weight", self.k_conv_weight, (HK, W))
        expect_shape("v_conv_weight", self.v_conv_weight, (HV, W))
        expect_shape("f_a_proj", self.f_a_proj, (None, Dm))
        expect_shape("f_b_proj", self.f_b_proj, (HK, self.f_a_proj.shape[0]))
        expect_shape("A_log", self.A_log, (H,))
        expect_shape("dt_bias", self.dt_bias, (HK,))
        expect_shape("b_proj", self.b_proj, (H, Dm))
        expect_shape("g_a_proj", self.g_a_proj, (None, Dm))
        expect_shape("g_b_proj", self.g_b_proj, (HV, self.g_a_proj.shape[0]))
        expect_shape("o_norm_weight", self.o_norm_weight, (self.head_v_dim,))
        expect_shape("o_proj", self.o_proj, (Dm, HV))

    @property
    def hidden_size(self) -> int:
        return self.q_proj.shape[1]

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the stored conv window: the q, k and v blocks."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_kernel(self) -> int:
        return self.q_conv_weight.shape[1]

    @property
    def conv_weight(self) -> Tensor:
        """``[2 H K + H V, W]``: the q, k and v conv taps as one depthwise conv."""
        return torch.cat([self.q_conv_weight, self.k_conv_weight, self.v_conv_weight], dim=0)

    @property
    def conv_bias(self) -> None:
        """Kimi's short convs have no bias; here so GDN and KDA weights read alike."""
        return None

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        *,
        eps: float,
        activation: str = "silu",
        prefix: str = "",
    ) -> KDAWeights:
        """Build from a state_dict of transformers' ``KimiLinearDeltaAttention``.

        Keys are read as ``prefix + name`` (e.g. ``prefix="model.layers.0.self_attn."``).
        Both namings are accepted: transformers' (fused ``conv1d.weight``,
        ``forget_gate.f_a_proj.weight``, ``forget_gate.A_log``, ...) and the
        original checkpoint's (``q_conv1d.weight``/``k_conv1d.weight``/
        ``v_conv1d.weight``, ``f_a_proj.weight``, ``A_log``, ``dt_bias``, ...).
        ``eps`` is ``config.rms_norm_eps`` and ``activation`` is
        ``config.hidden_act``; sizes are read from the tensor shapes (heads
        from ``A_log``, head sizes from ``q_proj``/``v_proj``).
        """

        def get(*names: str) -> Tensor:
            for name in names:
                if prefix + name in state_dict:
                    return state_dict[prefix + name]
            raise ValueError(f"state_dict: missing key {' or '.join(repr(prefix + n) for n in names)}")

        A_log = get("forget_gate.A_log", "A_log").reshape(-1)
        q_proj = get("q_proj.weight")
        v_proj = get("v_proj.weight")
        num_heads = A_log.numel()
        for name, proj in (("q_proj.weight", q_proj), ("v_proj.weight", v_proj)):
            if proj.dim() != 2 or proj.shape[0] % num_heads:
                raise ValueError(
                    f"{prefix + name}: expected rows a multiple of num_heads={num_heads} (from A_log), "
                    f"got shape {list(proj.shape)}"
                )
        key_dim, value_dim = q_proj.shape[0], v_proj.shape[0]

        if prefix + "conv1d.weight" in state_dict:
            conv = get("conv1d.weight")
            expect_shape(prefix + "conv1d.weight", conv, (2 * key_dim + value_dim, 1, None))
            q_conv, k_conv, v_conv = conv[:, 0, :].split([key_dim, key_dim, value_dim], dim=0)
        else:
            convs = []
            for name, rows in (
                ("q_conv1d.weight", key_dim),
                ("k_conv1d.weight", key_dim),
                ("v_conv1d.weight", value_dim),
            ):
                c = get(name)
                expect_shape(prefix + name, c, (rows, 1, None))
                convs.append(c[:, 0, :])
            q_conv, k_conv, v_conv = convs

        return cls(
            q_proj=q_proj,
            k_proj=get("k_proj.weight"),
            v_proj=v_proj,
            q_conv_weight=q_conv,
            k_conv_weight=k_conv,
            v_conv_weight=v_conv,
            f_a_proj=get("forget_gate.f_a_proj.weight", "f_a_proj.weight"),
            f_b_proj=get("forget_gate.f_b_proj.weight", "f_b_proj.weight"),
            A_log=A_log,
            dt_bias=get("forget_gate.dt_bias", "dt_bias").reshape(-1),
            b_proj=get("b_proj.weight"),
            g_a_proj=get("g_a_proj.weight"),
            g_b_proj=get("g_b_proj.weight"),
            o_norm_weight=get("o_norm.weight"),
            o_proj=get("o_proj.weight"),
            num_heads=num_heads,
            head_k_dim=key_dim // num_heads,
            head_v_dim=value_dim // num_heads,
            eps=float(eps),
            activation=activation,
        )


def kda_forget_gate(w: KDAWeights, x: Float[Tensor, "T Dmodel"]) -> Float[Tensor, "T H K"]:
    """Per-channel log-decay ``-exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)``, fp32.

    The softplus is ``log(1 + exp(y))``, switched to ``y`` above 20.
    """
    T = x.shape[0]
    y = row_linear(row_linear(x, w.f_a_proj), w.f_b_proj).float() + w.dt_bias.float()
    y = y.reshape(T, w.num_heads, w.head_k_dim)
    softplus = pointwise(lambda y: torch.where(y > 20.0, y, torch.log(1.0 + torch.exp(y))), y)
    return -w.A_log.float().exp()[:, None] * softplus


def rmsnorm_sigmoid_gate(
    x: Float[Tensor, "*batch V"], gate: Float[Tensor, "*batch V"], weight: Float[Tensor, " V"], *, eps: float
) -> Float[Tensor, "*batch V"]:
    """Kimi's gated RMSNorm: ``weight * rmsnorm(x) * sigmoid(gate)``, all in fp32, returned in ``x.dtype``.

    Unlike Qwen's, the normalised value is not rounded before the weight: the
    whole norm runs on fp32 copies (`common.rms_norm` of fp32 in, fp32 out).
    """
    h = rms_norm(x.float(), weight.float(), eps)
    return (h * pointwise(torch.sigmoid, gate.float())).to(x.dtype)


def kda_project(
    w: KDAWeights, x: Float[Tensor, "T Dmodel"]
) -> tuple[Float[Tensor, "T C"], Float[Tensor, "T H V"], Float[Tensor, "T H K"], Float[Tensor, "T H"]]:
    """The input projections: ``(conv_input, gate, g, beta)``.

    ``conv_input`` ``[T, C]`` is ``q_proj(x) | k_proj(x) | v_proj(x)`` before the
    conv; ``gate`` ``[T, H, V]`` is the output gate ``g_b(g_a(x))`` before its
    sigmoid; ``g`` ``[T, H, K]`` is the fp32 per-channel log-decay; ``beta``
    ``[T, H]`` is ``sigmoid(b_proj(x))``. All but ``g`` are in ``x.dtype``.
    """
    expect_float("x", x)
    expect_shape("x", x, (None, w.hidden_size))
    T = x.shape[0]
    conv_input = torch.cat([row_linear(x, w.q_proj), row_linear(x, w.k_proj), row_linear(x, w.v_proj)], dim=-1)
    gate = row_linear(row_linear(x, w.g_a_proj), w.g_b_proj).reshape(T, w.num_heads, w.head_v_dim)
    g = kda_forget_gate(w, x)
    beta = pointwise(torch.sigmoid, row_linear(x, w.b_proj))
    return conv_input, gate, g, beta


def kda_finish(w: KDAWeights, o: Float[Tensor, "T H V"], gate: Float[Tensor, "T H V"]) -> Float[Tensor, "T Dmodel"]:
    """The sigmoid-gated RMSNorm and the output projection, in ``gate.dtype`` (the activation dtype)."""
    expect_shape("o", o, (None, w.num_heads, w.head_v_dim))
    expect_shape("gate", gate, (o.shape[0], w.num_heads, w.head_v_dim))
    o = rmsnorm_sigmoid_gate(o.to(gate.dtype), gate, w.o_norm_weight, eps=w.eps)
    return row_linear(o.reshape(o.shape[0], w.value_dim), w.o_proj)


def kda_layer(
    w: KDAWeights,
    x: Float[Tensor, "T Dmodel"],
    conv_window: Float[Tensor, "C W1"],
    state: Float[Tensor, "H K V"],
    *,
    chunked: bool = False,
    chunk_size: int = 64,
    scale: float | None = None,
) -> RecurrentLayerOutput:
    """One Kimi Delta Attention layer over ``T`` new tokens of one request.

    ``conv_window`` is ``[2 H K + H V, W - 1]`` (q, k, v blocks; zeros for a
    fresh request); ``state`` is the recurrent state ``[H, K, V]`` (zeros for
    a fresh request). ``chunked=True`` uses the chunked recurrence (prefill);
    otherwise the token-by-token form runs and the state after every token is
    returned in ``states``. ``scale`` defaults to ``K ** -0.5``. Output is in
    ``x.dtype``; states keep the dtype of ``state``.
    """
    expect_float("x", x)
    expect_shape("x", x, (None, w.hidden_size))
    expect_shape("conv_window", conv_window, (w.conv_dim, w.conv_kernel - 1))
    expect_shape("state", state, (w.num_heads, w.head_k_dim, w.head_v_dim))
    T = x.shape[0]
    scale = w.head_k_dim**-0.5 if scale is None else scale

    conv_input, gate, g, beta = kda_project(w, x)
    mixed, conv_windows = causal_conv1d(conv_input, w.conv_weight, None, conv_window, activation=w.activation)
    q, k, v = kda_qkv(mixed, num_heads=w.num_heads, head_k_dim=w.head_k_dim, head_v_dim=w.head_v_dim)

    if chunked:
        o, new_state = gated_delta_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)
        states = None
    else:
        o, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=scale)
        new_state = states[-1] if T else state.clone()

    out = kda_finish(w, o, gate)
    new_window = conv_windows[-1] if T else conv_window.to(x.dtype, copy=True)
    return RecurrentLayerOutput(out, new_window, new_state, conv_windows, states)
