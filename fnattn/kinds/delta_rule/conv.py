"""Depthwise causal short convolution with an explicit left-context window.

GDN and KDA layers run a short depthwise convolution (kernel ``W``, usually 4)
over their q/k/v channels before the recurrence. Across steps the only state is
the last ``W - 1`` inputs, stored as a window ``[C, W - 1]`` (oldest first, see
``docs/layout.md``). A fresh request starts from a zero window.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kernels.gdn_naive import activate, causal_conv1d_seq

__all__ = ["ACTIVATIONS", "apply_activation", "check_activation", "causal_conv1d"]

#: Activation names accepted after the convolution (``None`` means none).
ACTIVATIONS = (None, "identity", "silu", "swish", "sigmoid")


def check_activation(activation: str | None) -> None:
    """Raise ``ValueError`` unless ``activation`` is one of ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def apply_activation(x: Tensor, activation: str | None) -> Tensor:
    """Apply a named activation from ``ACTIVATIONS``."""
    check_activation(activation)
    return activate(x, activation)


def causal_conv1d(
    x: Float[Tensor, "T C"],
    weight: Float[Tensor, "C W"],
    bias: Float[Tensor, " C"] | None,
    window: Float[Tensor, "C W1"],
    *,
    activation: str | None,
) -> tuple[Float[Tensor, "T C"], Float[Tensor, "T C W1"]]:
    """Depthwise causal convolution of ``x`` continuing from ``window``.

    ``y[t, c] = act(bias[c] + sum_j weight[c, j] * u[c, t + j])`` where ``u`` is
    ``window`` followed by ``x`` along time. The math runs in fp32; ``y`` is
    returned in ``x.dtype``.

    Returns ``(y, window_after)``: ``window_after[t]`` is the window after token
    ``t`` (the last ``W - 1`` inputs up to and including ``t``, oldest first), in
    ``x.dtype``. ``window_after[-1]`` is the new state.
    """
    expect_float("x", x)
    expect_shape("x", x, (None, None))
    T, C = x.shape
    expect_shape("weight", weight, (C, None))
    W = weight.shape[1]
    if W < 1:
        raise ValueError(f"weight: expected a kernel width >= 1, got shape [{C}, {W}]")
    if bias is not None:
        expect_shape("bias", bias, (C,))
    expect_shape("window", window, (C, W - 1))
    check_activation(activation)

    if T == 0:
        return x.new_empty((0, C)), x.new_empty((0, C, W - 1))
    # The arithmetic is kernels' (the reference of its conv kernel); the window is
    # taken in x.dtype, so window_after holds inputs of x.dtype exactly.
    y, window_after = causal_conv1d_seq(x, weight, bias, window.to(x.dtype), activation)
    return y.to(x.dtype), window_after.to(x.dtype)
