"""Opt-in GDN / KDA decode backend ``triton_fused``: the whole decode step in one Triton launch.

The ``triton`` decode runs `kernels.causal_conv1d` and then
`kernels.gated_delta_recurrent`, with the conv output going through memory between
them. ``triton_fused`` runs `kernels.gated_delta_decode_fused`, which convolves each
request's new token over its conv window, splits and l2-normalizes q/k, and applies the
one-token gated delta rule in the same program. Its plan, its reads (slot -1: zero
window and state) and its writes are those of ``triton``: with a ring the new states go
straight into the batch's spare ring rows (``ssm=None``), otherwise they leave as
values; the new conv windows always leave as a tensor [B, C, W - 1].

It comes first in `DEFAULT_PREFER` for decode on CUDA: in a batch-1 Qwen3.5-0.8B step it takes
5.8 us a layer against 8.7 us for the conv and recurrent launches it replaces (``fnattn bench model
--profile``). ``ModelAttention(specs, prefer=["triton", ...])`` keeps the two-launch path.
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import RecurrentInputs, RecurrentOutput
from .reference import check_inputs
from .triton import _plan_of, plan, supports

NAME = "triton_fused"


def _decode(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    from ...kernels import gated_delta_decode_fused

    check_inputs(spec, inputs)
    c, p = spec.config, _plan_of(spec, inputs)
    into = dict(out_states=views.ssm, out_rows=p.write_slots) if p.in_ring else {}
    o, states, windows = gated_delta_decode_fused(
        inputs.x, inputs.conv_weight, inputs.conv_bias, views.conv, inputs.g, inputs.beta, views.ssm, p.read_slots,
        inputs.meta.batch.cu_seqlens, num_k_heads=c.num_qk_heads, head_k_dim=c.head_k_dim, scale=c.scale,
        activation="silu", use_qk_l2norm=True, **into)  # [T, H, V], [B, H, K, V] or the pool, [B, C, W - 1]
    return RecurrentOutput(o=o), writes(ssm=None if into else states, conv=windows)


# Invariant: its V tile narrowed with the batch (`fill_device`), which moved a request's decode logits with its
# batch at the Qwen3.5-0.8B widths (H100, 7499ad0). In the invariant mode the tile no longer narrows, and with
# the usual tile its outputs, states and windows are ``triton``'s, the verify path's, bit for bit at batch 1, 4,
# 33 and 256 for every GDN and KDA shape tested (tests/gpu_results/gdn_usual_tile_gpu.json, H100, 17476a0).
_guards = [register(kind, "decode", NAME, supports=supports, plan=plan, capturable=True, invariant=True)(_decode)
           for kind in ("gdn", "kda")]
# The module's name runs only through a session from here on, like every registered backend.
_decode = _guards[0]
