"""The Gated DeltaNet layer of Qwen3.5 / Qwen3-Next as a pure function of its checkpoint weights and states.

``gdn_layer`` reproduces transformers' ``Qwen3_5GatedDeltaNet`` and
``Qwen3NextGatedDeltaNet`` for one request. It is built from three pieces a
model can also call around an attention session (projections and the output
norm stay with the model; the conv, q/k/v split and recurrence are the
backend's)::

    gdn_project(w, x) -> (conv_input, z, g, beta)
    causal conv + gdn_qkv(...) + gated delta rule      # the backend's part
    gdn_finish(w, o, z) -> out

In full::

    x -> in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
      -> causal conv over [q | k | v] channels (with the conv window state), activation
      -> split q [Hk, K], k [Hk, K], v [HV, V]; l2-normalize q and k (fp32)
      -> g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
      -> gated delta rule (q/k heads repeated to the HV value heads)
      -> RMSNorm per head, times silu(z) -> out_proj

Qwen3-Next stores the same projections fused and interleaved per key head
(``in_proj_qkvz`` and ``in_proj_ba``); ``GDNWeights.from_state_dict`` reorders
them once into the Qwen3.5 layout, so one function serves both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kinds.delta_rule.conv import causal_conv1d, check_activation
from fnattn.kinds.delta_rule.math import RecurrentLayerOutput, gated_delta_chunked, gated_delta_recurrent
from fnattn.kinds.delta_rule.qkv import gdn_qkv

from .common import rms_norm
from .fused import SplitNorm, gated_projection, gdn_gating, linear, project_and_gate  # CUDA kernels

__all__ = [
    "GDNWeights",
    "RecurrentLayerOutput",
    "gated_rmsnorm_silu",
    "gdn_finish",
    "gdn_layer",
    "gdn_project",
]


@dataclass(frozen=True, eq=False)
class GDNWeights:
    """Weights of one Gated DeltaNet layer, in the Qwen3.5 projection layout.

    Dimensions: ``Dmodel`` hidden size, ``Hk`` key heads of size ``K``, ``H``
    value heads of size ``V`` (``H`` a multiple of ``Hk``; ``HV = H * V``),
    ``C = 2 Hk K + H V`` conv channels (q, then k, then v), ``W`` conv kernel
    width.
    """

    in_proj_qkv: Float[Tensor, "C Dmodel"]
    in_proj_z: Float[Tensor, "HV Dmodel"]
    in_proj_b: Float[Tensor, "H Dmodel"]
    in_proj_a: Float[Tensor, "H Dmodel"]
    conv_weight: Float[Tensor, "C W"]
    conv_bias: Float[Tensor, " C"] | None
    A_log: Float[Tensor, " H"]
    dt_bias: Float[Tensor, " H"]
    norm_weight: Float[Tensor, " V"]
    out_proj: Float[Tensor, "Dmodel HV"]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    eps: float = 1e-6
    activation: str = "silu"
    # Set by `from_state_dict`: the four input projections as one [C + HV + 2H, D] weight (one GEMM; the four
    # fields above are row views of it), and the fp32 decay factors the recurrence takes (-exp(A_log), dt_bias).
    in_proj: Float[Tensor, "P Dmodel"] | None = None
    neg_decay: Float[Tensor, " H"] | None = None
    dt_bias_f32: Float[Tensor, " H"] | None = None

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads: expected a multiple of num_k_heads={self.num_k_heads}, got {self.num_v_heads}"
            )
        check_activation(self.activation)
        expect_shape("in_proj_qkv", self.in_proj_qkv, (self.conv_dim, None))
        D = self.in_proj_qkv.shape[1]
        expect_shape("in_proj_z", self.in_proj_z, (self.value_dim, D))
        expect_shape("in_proj_b", self.in_proj_b, (self.num_v_heads, D))
        expect_shape("in_proj_a", self.in_proj_a, (self.num_v_heads, D))
        expect_shape("conv_weight", self.conv_weight, (self.conv_dim, None))
        if self.conv_bias is not None:
            expect_shape("conv_bias", self.conv_bias, (self.conv_dim,))
        expect_shape("A_log", self.A_log, (self.num_v_heads,))
        expect_shape("dt_bias", self.dt_bias, (self.num_v_heads,))
        expect_shape("norm_weight", self.norm_weight, (self.head_v_dim,))
        expect_shape("out_proj", self.out_proj, (D, self.value_dim))
        if self.in_proj is not None:
            expect_shape("in_proj", self.in_proj, (self.conv_dim + self.value_dim + 2 * self.num_v_heads, D))
        for name in ("neg_decay", "dt_bias_f32"):
            if getattr(self, name) is not None:
                expect_shape(name, getattr(self, name), (self.num_v_heads,))

    @property
    def hidden_size(self) -> int:
        return self.in_proj_qkv.shape[1]

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_kernel(self) -> int:
        return self.conv_weight.shape[1]

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        *,
        num_k_heads: int,
        eps: float,
        activation: str = "silu",
        prefix: str = "",
    ) -> GDNWeights:
        """Build from a transformers state_dict of ``Qwen3_5GatedDeltaNet`` or ``Qwen3NextGatedDeltaNet``.

        Keys are read as ``prefix + name`` (e.g. ``prefix="model.layers.0.linear_attn."``).
        The layout is recognised by ``in_proj_qkv.weight`` (Qwen3.5) or
        ``in_proj_qkvz.weight`` (Qwen3-Next). ``num_k_heads`` is
        ``config.linear_num_key_heads``, ``eps`` is ``config.rms_norm_eps`` and
        ``activation`` is ``config.hidden_act``; every other size is read from
        the tensor shapes.
        """

        def get(name: str) -> Tensor:
            key = prefix + name
            if key not in state_dict:
                raise ValueError(f"state_dict: missing key {key!r}")
            return state_dict[key]

        A_log = get("A_log")
        norm_weight = get("norm.weight")
        conv = get("conv1d.weight")  # [C, 1, W]
        expect_shape(prefix + "conv1d.weight", conv, (None, 1, None))
        num_v_heads = A_log.numel()
        head_v_dim = norm_weight.numel()
        value_dim = num_v_heads * head_v_dim
        key_dim2 = conv.shape[0] - value_dim
        if key_dim2 <= 0 or key_dim2 % (2 * num_k_heads):
            raise ValueError(
                f"num_k_heads: {num_k_heads} does not divide the key channels of conv1d.weight "
                f"(shape {list(conv.shape)}, value channels {value_dim})"
            )
        head_k_dim = key_dim2 // (2 * num_k_heads)
        conv_bias = state_dict.get(prefix + "conv1d.bias")

        if prefix + "in_proj_qkv.weight" in state_dict:
            in_proj_qkv = get("in_proj_qkv.weight")
            in_proj_z = get("in_proj_z.weight")
            in_proj_b = get("in_proj_b.weight")
            in_proj_a = get("in_proj_a.weight")
        elif prefix + "in_proj_qkvz.weight" in state_dict:
            in_proj_qkv, in_proj_z, in_proj_b, in_proj_a = _split_qwen3_next_projections(
                get("in_proj_qkvz.weight"),
                get("in_proj_ba.weight"),
                num_k_heads=num_k_heads,
                num_v_heads=num_v_heads,
                head_k_dim=head_k_dim,
                head_v_dim=head_v_dim,
            )
        else:
            raise ValueError(
                f"state_dict: expected {prefix + 'in_proj_qkv.weight'!r} (Qwen3.5) or "
                f"{prefix + 'in_proj_qkvz.weight'!r} (Qwen3-Next)"
            )

        # One GEMM instead of four: the four projections become row views of one fused weight.
        in_proj = torch.cat([in_proj_qkv, in_proj_z, in_proj_b, in_proj_a], dim=0)
        in_proj_qkv, in_proj_z, in_proj_b, in_proj_a = in_proj.split(
            [in_proj_qkv.shape[0], in_proj_z.shape[0], in_proj_b.shape[0], in_proj_a.shape[0]], dim=0)
        A_log, dt_bias = get("A_log"), get("dt_bias")
        return cls(
            in_proj_qkv=in_proj_qkv,
            in_proj_z=in_proj_z,
            in_proj_b=in_proj_b,
            in_proj_a=in_proj_a,
            conv_weight=conv[:, 0, :],
            conv_bias=conv_bias,
            A_log=A_log,
            dt_bias=dt_bias,
            norm_weight=norm_weight,
            out_proj=get("out_proj.weight"),
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            eps=float(eps),
            activation=activation,
            in_proj=in_proj,
            neg_decay=-A_log.float().exp(),
            dt_bias_f32=dt_bias.float(),
        )


def _split_qwen3_next_projections(
    qkvz: Tensor,
    ba: Tensor,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reorder Qwen3-Next's per-key-head interleaved projections into the Qwen3.5 layout.

    Qwen3-Next groups the output rows by key head: for each of the ``Hk`` key
    heads, ``[q (K), k (K), v (r V), z (r V)]`` in ``in_proj_qkvz`` and
    ``[b (r), a (r)]`` in ``in_proj_ba``, where ``r = HV / Hk``. Value head
    ``h`` is sub-head ``h % r`` of key head ``h // r``.
    """
    r = num_v_heads // num_k_heads
    group = 2 * head_k_dim + 2 * r * head_v_dim
    expect_shape("in_proj_qkvz.weight", qkvz, (num_k_heads * group, None))
    D = qkvz.shape[1]
    expect_shape("in_proj_ba.weight", ba, (num_k_heads * 2 * r, D))
    q, k, v, z = qkvz.reshape(num_k_heads, group, D).split(
        [head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1
    )
    b, a = ba.reshape(num_k_heads, 2 * r, D).split([r, r], dim=1)
    in_proj_qkv = torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)], dim=0)
    return in_proj_qkv, z.reshape(-1, D), b.reshape(-1, D), a.reshape(-1, D)


def gated_rmsnorm_silu(
    x: Float[Tensor, "*batch V"], gate: Float[Tensor, "*batch V"], weight: Float[Tensor, " V"], *, eps: float
) -> Float[Tensor, "*batch V"]:
    """Qwen's gated RMSNorm: ``(weight * rmsnorm(x)) * silu(gate)``.

    The normalization runs in fp32 and is rounded to ``x.dtype`` before the
    weight is applied (`common.rms_norm`); the gate product runs in fp32 and
    the result is returned in ``x.dtype``.
    """
    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def gdn_project(
    w: GDNWeights, x: Float[Tensor, "T Dmodel"] | SplitNorm
) -> tuple[Float[Tensor, "T C"], Float[Tensor, "T H V"], Float[Tensor, "T H"], Float[Tensor, "T H"]]:
    """The input projections: ``(conv_input, z, g, beta)``; ``x`` may be a `fused.SplitNorm` (the layer's
    input norm, finished by the projection).

    ``conv_input`` ``[T, C]`` holds the q | k | v channels before the causal
    conv; ``z`` ``[T, H, V]`` is the output gate; ``g`` ``[T, H]`` is the fp32
    log-decay ``-exp(A_log) * softplus(a + dt_bias)``; ``beta`` ``[T, H]`` is
    ``sigmoid(b)``. All but ``g`` are in ``x.dtype``.
    """
    rows = x.x if isinstance(x, SplitNorm) else x
    expect_float("x", rows)
    expect_shape("x", rows, (None, w.hidden_size))
    T, H = rows.shape[0], w.num_v_heads
    # fp32 where the math needs it: the log-decay feeds an exp inside the recurrence.
    neg_decay = -w.A_log.float().exp() if w.neg_decay is None else w.neg_decay
    dt_bias = w.dt_bias.float() if w.dt_bias_f32 is None else w.dt_bias_f32
    if w.in_proj is not None:  # one GEMM; the parts are column slices of its output, b and a the last
        y, g, beta = project_and_gate(x, w.in_proj, w.conv_dim + w.value_dim, neg_decay, dt_bias)
        conv_input, z = y[..., :w.conv_dim], y[..., w.conv_dim:w.conv_dim + w.value_dim]
    else:
        conv_input, z, b, a = (linear(x, p) for p in (w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a))
        g, beta = gdn_gating(a, b, neg_decay, dt_bias)  # one launch on CUDA; a is promoted to fp32 in the add
    return conv_input, z.reshape(T, H, w.head_v_dim), g, beta


def gdn_finish(w: GDNWeights, o: Float[Tensor, "T H V"], z: Float[Tensor, "T H V"], project=linear):
    """The gated RMSNorm and the output projection, in ``z.dtype`` (the activation dtype): ``[T, Dmodel]``.
    ``project(x, weight)``: the projection (a model may fold the residual add and the next norm into it)."""
    expect_shape("o", o, (None, w.num_v_heads, w.head_v_dim))
    expect_shape("z", z, (o.shape[0], w.num_v_heads, w.head_v_dim))
    return gated_projection(o, ("silu_norm", z, w.norm_weight, w.eps), w.out_proj, project)


def gdn_layer(
    w: GDNWeights,
    x: Float[Tensor, "T Dmodel"],
    conv_window: Float[Tensor, "C W1"],
    state: Float[Tensor, "H K V"],
    *,
    chunked: bool = False,
    chunk_size: int = 64,
    scale: float | None = None,
) -> RecurrentLayerOutput:
    """One Gated DeltaNet layer over ``T`` new tokens of one request.

    ``conv_window`` is the last ``W - 1`` conv inputs before these tokens (zeros
    for a fresh request); ``state`` is the recurrent state (zeros for a fresh
    request). ``chunked=True`` uses the chunked recurrence (prefill); otherwise
    the token-by-token form runs and the state after every token is returned
    in ``states``. ``scale`` defaults to ``K ** -0.5``. Output is in
    ``x.dtype``; states keep the dtype of the ``state`` argument.
    """
    expect_float("x", x)
    expect_shape("x", x, (None, w.hidden_size))
    expect_shape("conv_window", conv_window, (w.conv_dim, w.conv_kernel - 1))
    expect_shape("state", state, (w.num_v_heads, w.head_k_dim, w.head_v_dim))
    T = x.shape[0]
    scale = w.head_k_dim**-0.5 if scale is None else scale

    conv_input, z, g, beta = gdn_project(w, x)
    mixed, conv_windows = causal_conv1d(conv_input, w.conv_weight, w.conv_bias, conv_window, activation=w.activation)
    q, k, v = gdn_qkv(mixed, num_k_heads=w.num_k_heads, num_v_heads=w.num_v_heads, head_k_dim=w.head_k_dim,
                      head_v_dim=w.head_v_dim)

    if chunked:
        o, new_state = gated_delta_chunked(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)
        states = None
    else:
        o, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=scale)
        new_state = states[-1] if T else state.clone()

    out = gdn_finish(w, o, z)
    new_window = conv_windows[-1] if T else conv_window.to(x.dtype, copy=True)
    return RecurrentLayerOutput(out, new_window, new_state, conv_windows, states)
