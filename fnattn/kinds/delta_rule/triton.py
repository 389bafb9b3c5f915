"""Triton backends for Gated DeltaNet and Kimi Delta Attention, and fla-core as a prefill provider.

Same contract as the reference backends (`.reference`): the causal
conv continuing from the request's conv window, silu, the q/k/v split with
l2-normalized q and k, and the gated delta rule continuing from the request's
recurrent state; the new states leave as the layer's writes. The kernels
(`fnattn.kernels.gated_delta`) read the pools by slot and never write a row being read:

* prefill: `causal_conv1d` + `gated_delta_chunked` (the "fla" provider runs
  fla-core's `chunk_gated_delta_rule` / `chunk_kda` after the same conv);
* decode: `causal_conv1d` + `gated_delta_recurrent`, one state row per request;
* verify: both with ``per_position_states``, one state row per token.

When the batch has a ring (`State`), decode and verify write the new states
straight into its spare ring rows, which `State` hands out for that step and
which no request reads, and return ``ssm=None``: the apply then moves ring
positions and copies nothing but the small conv windows. Otherwise the states
leave as values, like prefill's.

The group's plan is built once per step and shared by its layers: the slot each
request reads (-1 when nothing is cached: a reused slot may still hold another
request's state), the slots of the write rows and prefill's chunk list. Decode
and verify then read nothing back to the host, so they can be captured in a
CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ...switches import declare, switched
from ..availability import needs_cuda, needs_dtype, package_missing
from .config import RecurrentInputs, RecurrentOutput
from .reference import check_inputs

#: Tokens per chunk of the chunked (prefill) kernels: a power of two >= 16.
CHUNK_SIZE = 64

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLA_DIRECT = declare(
    "fla_direct", True, __name__,
    on="the \"fla\" GDN prefill provider calls fla-core's chunk forward itself, with the plan's chunk list",
    off="fla-core's public ``chunk_gated_delta_rule`` and its wrappers",
    why="the same kernels in the same order (the same bits), and an 8192-token prefill step 0.943x the public "
        "path's on the H200")


def fla_direct(enabled: bool):
    """Within this block the "fla" GDN prefill provider calls fla-core's chunk forward itself
    (`_fla_gdn_forward`: l2norm of q and k, then ``chunk_gated_delta_rule_fwd``, with the plan's chunk
    list as its ``chunk_indices``) in place of the public ``chunk_gated_delta_rule`` and its wrappers. On by
    default: the same kernels in the same order, so the same bits
    (``tests/gpu_results/fla_prefill_gpu.json``), and an 8192-token prefill step 0.943x the public path's
    over 24 interleaved steps (``benchmarks/results/bench_prefill_ab.json``; benchmarks/NOTES.md has the
    shorter runs). ``fla_direct(False)``: the public function."""
    return switched(_FLA_DIRECT, "fla_direct", enabled)


_QKV_APART = declare(
    "qkv_apart", True, __name__,
    on="the \"fla\" prefill provider has the conv write q, k and v as three contiguous tensors",
    off="one [T, C] conv output whose column slices fla-core copies to contiguous",
    why="three launches fewer a layer, the same bits; the 8192-token Qwen3.5-0.8B prefill step took 1.011x "
        "as long with it off on the H200")


def qkv_apart(enabled: bool):
    """Within this block the "fla" prefill provider has the conv write q, k and v as three contiguous tensors
    (`kernels.causal_conv1d`'s ``split``) when ``enabled``, in place of one [T, C] output whose column slices
    fla-core's chunk copies to contiguous: three launches fewer a GDN / KDA layer (54 a Qwen3.5-0.8B prefill,
    whose copies took 2.26 ms of an 8192-token prefill on the H200), the same bits
    (``tests/gpu_results/gdn_prefill_gpu.json``). On by default: the 8192-token prefill step with it off took
    1.011x as long, paired by round (``benchmarks/results/bench_conv_ab.json``, a host-bound step)."""
    return switched(_QKV_APART, "qkv_apart", enabled)


@dataclass(frozen=True)
class RecurrentPlan:
    read_slots: Tensor  # [B] int64: the row each request starts from, -1: fresh (zero states)
    write_slots: Tensor  # [R] int64: row of each new state; R = B, or T for verify (Batch.recurrent_write_rows)
    in_ring: bool = False  # write_slots are spare ring rows the kernels may fill in place
    chunks: tuple[Tensor, Tensor] | None = None  # prefill: (request, chunk of request) per chunk, int32
    chunk_size: int = CHUNK_SIZE
    cu_seqlens_long: Tensor | None = None  # [B + 1] int64 (fla-core's cu_seqlens)
    cu_seqlens_cpu: Tensor | None = None  # [B + 1] int64 on the host: fla-core then needs no sync
    fla_chunks: Tensor | None = None  # prefill: [chunks, 2] int64 (request, chunk of request): fla-core's chunk_indices
    start_rows: Tensor | None = None  # prefill: [B] int64, read_slots with fresh requests at row 0 (gathered, zeroed)
    fresh: Tensor | None = None  # prefill: [B, 1, 1, 1] bool, the requests that start from zero states


def _chunk_list(batch, chunk_size: int) -> tuple[Tensor, Tensor]:
    """`kernels.chunk_indices` from the host lengths: no device read-back, and on CUDA one copy from pinned
    memory, which does not wait for the work queued before it (a copy from pageable memory does)."""
    seq, idx = [], []
    for b, n in enumerate(batch.host_new_lens):
        count = -(-n // chunk_size)
        seq += [b] * count
        idx += range(count)
    device = batch.cu_seqlens.device
    both = torch.tensor([seq, idx], dtype=torch.int32)  # [2, chunks]
    both = both.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else both.to(device)
    return both[0], both[1]


def padded_chunk_list(cu_seqlens: Tensor, tokens: int, chunk_size: int) -> Tensor:
    """fla-core's ``chunk_indices`` ``[chunks, 2]`` int64 (request, chunk of request) from the device's
    ``cu_seqlens`` ``[B + 1]`` alone, with room for any lengths of ``tokens`` in all: ``ceil(tokens /
    chunk_size) + B`` entries, the requests' chunks in order, then entries past the last request's end,
    which every chunk kernel masks whole (no row of theirs is loaded or stored). Its shape is the batch's
    shapes', so a step that builds it may be captured per (lanes, tokens) bucket."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    B = lens.shape[0]
    counts = (lens + chunk_size - 1) // chunk_size  # [B]
    ends = counts.cumsum(0)  # [B] where each request's chunks end in the list
    slots = torch.arange(-(-tokens // chunk_size) + B, device=cu_seqlens.device)  # [chunks]
    request = torch.searchsorted(ends, slots, right=True).clamp(max=B - 1)  # past the end: the last request
    chunk = slots - (ends - counts).index_select(0, request)  # past the end: >= the last request's chunks
    return torch.stack([request, chunk], dim=1).long()


def static_plan(specs, batch, lease) -> RecurrentPlan:
    """`plan` for the "fla" prefill provider; inside `fnattn.lanes.static_shapes` (a bucket's step) built from
    the batch's device tensors alone, with `padded_chunk_list`: no host value, no copy from the host, shapes
    fixed by the bucket, so the step's graph may hold the layer (`fnattn.prefill_graph`)."""
    from ...lanes import in_static_step

    if batch.phase != "prefill" or not in_static_step():
        return plan(specs, batch, lease)
    read = batch.recurrent_slots.masked_fill(batch.cache_lens == 0, -1)  # [B]
    return RecurrentPlan(read_slots=read, write_slots=batch.recurrent_write_rows, in_ring=bool(batch.ring),
                         chunk_size=CHUNK_SIZE, cu_seqlens_long=batch.cu_seqlens.long(),
                         fla_chunks=padded_chunk_list(batch.cu_seqlens, batch.num_tokens, CHUNK_SIZE),
                         start_rows=read.clamp(min=0), fresh=(read < 0)[:, None, None, None])


def plan(specs, batch, lease) -> RecurrentPlan:
    """Per-step slot tensors (and chunk list), built once for every layer of a group."""
    # From the device tensors, not the host copies: no host-to-device copy, so building it may be captured too.
    read = batch.recurrent_slots.masked_fill(batch.cache_lens == 0, -1)  # [B]
    write = batch.recurrent_write_rows  # [B] or [T]
    in_ring = bool(batch.ring)
    if batch.phase != "prefill":
        return RecurrentPlan(read_slots=read, write_slots=write, in_ring=in_ring)
    cu_cpu = torch.tensor(batch.host_cu_seqlens, dtype=torch.long)
    chunks = _chunk_list(batch, CHUNK_SIZE)
    return RecurrentPlan(read_slots=read, write_slots=write, in_ring=in_ring, chunks=chunks, chunk_size=CHUNK_SIZE,
                         cu_seqlens_long=batch.cu_seqlens.long(), cu_seqlens_cpu=cu_cpu,
                         fla_chunks=torch.stack(chunks, 1).long(), start_rows=read.clamp(min=0),
                         fresh=(read < 0)[:, None, None, None])


def _plan_of(spec, inputs) -> RecurrentPlan:
    meta = inputs.meta
    return meta.plan if meta.plan is not None else plan((spec,), meta.batch, meta.workspace)


def _conv(spec, views, inputs, p: RecurrentPlan, *, per_token: bool, split=None):
    """``-> (mixed [T, C], windows)``: windows [B, C, W - 1], or [T, C, W - 1] per token; with ``split``
    (`kernels.causal_conv1d`'s) mixed is its three contiguous parts."""
    from ...kernels import causal_conv1d

    tiles = dict(chunks=p.chunks, chunk_size=p.chunk_size) if p.chunks is not None else {}
    return causal_conv1d(inputs.x, inputs.conv_weight, inputs.conv_bias, views.conv, p.read_slots,
                         inputs.meta.batch.cu_seqlens, activation="silu", per_position_states=per_token,
                         split=split, **tiles)


def _split(spec, mixed: Tensor | tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Views of the conv output (or of its three parts, `_qkv_channels`): q, k [T, Hk, K] (GDN's key heads,
    not repeated) and v [T, H, V]."""
    c = spec.config
    hk = c.num_qk_heads
    if isinstance(mixed, tuple):
        q, k, v = mixed
    else:
        qk = hk * c.head_k_dim
        q, k, v = mixed[:, :qk], mixed[:, qk : 2 * qk], mixed[:, 2 * qk :]
    return (q.unflatten(1, (hk, c.head_k_dim)), k.unflatten(1, (hk, c.head_k_dim)),
            v.unflatten(1, (c.num_state_heads, c.head_v_dim)))


def _qkv_channels(spec) -> tuple[int, int]:
    """Where k's and v's channels start in the conv output."""
    qk = spec.config.num_qk_heads * spec.config.head_k_dim
    return qk, 2 * qk


def _write(states: Tensor | None, windows: Tensor) -> Writes:
    return writes(ssm=states, conv=windows)


def _recurrent(spec, views, inputs, p: RecurrentPlan, q, k, v, *, per_token: bool):
    """``-> (o, states or None)``: with a ring the kernel writes the new states straight
    into the batch's spare ring rows (never a row being read) and nothing is left to copy."""
    from ...kernels import gated_delta_recurrent

    into = dict(out_states=views.ssm, out_rows=p.write_slots) if p.in_ring else {}
    o, states = gated_delta_recurrent(q, k, v, inputs.g, inputs.beta, views.ssm, p.read_slots,
                                      inputs.meta.batch.cu_seqlens, scale=spec.config.scale,
                                      per_position_states=per_token, use_qk_l2norm=True, **into)
    return o, (None if into else states)


# ------------------------------------------------------------------ triton


def _prefill(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    from ...kernels import gated_delta_chunked

    check_inputs(spec, inputs)
    if invariant_on():  # decode's launches over every prompt token: a token's bits are the same in every phase
        return _one_state_a_request(spec, views, inputs, replace(_plan_of(spec, inputs), in_ring=False, chunks=None))
    c, p = spec.config, _plan_of(spec, inputs)
    mixed, windows = _conv(spec, views, inputs, p, per_token=False)  # [T, C], [B, C, W - 1]
    q, k, v = _split(spec, mixed)
    o, states = gated_delta_chunked(q, k, v, inputs.g, inputs.beta, views.ssm, p.read_slots,
                                    inputs.meta.batch.cu_seqlens, scale=c.scale, chunk_size=p.chunk_size,
                                    use_qk_l2norm=True, chunks=p.chunks)  # [T, H, V], [B, H, K, V]
    return RecurrentOutput(o=o), _write(states, windows)


def _decode(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    check_inputs(spec, inputs)
    return _one_state_a_request(spec, views, inputs, _plan_of(spec, inputs))


def _one_state_a_request(spec, views, inputs, p: RecurrentPlan) -> tuple[RecurrentOutput, Writes]:
    """The conv and the recurrence token by token over each request's new tokens, one state row a request out:
    decode's launches; in the invariant mode prefill's too (its states then leave as values, ``p.in_ring``
    False)."""
    mixed, windows = _conv(spec, views, inputs, p, per_token=False)  # [T, C], [B, C, W - 1]
    q, k, v = _split(spec, mixed)
    o, states = _recurrent(spec, views, inputs, p, q, k, v, per_token=False)  # [T, H, V], [B, H, K, V] | None
    return RecurrentOutput(o=o), _write(states, windows)


def _verify(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes | None]:
    from ...kernels import gated_delta_recurrent

    check_inputs(spec, inputs)
    c, p = spec.config, _plan_of(spec, inputs)
    replay = replace(inputs, meta=None)
    if inputs.meta.batch.recovery == "replay":
        # Only the inputs leave the step: no state per draft position is kept.
        mixed, _ = _conv(spec, views, inputs, p, per_token=False)
        q, k, v = _split(spec, mixed)
        o, _ = gated_delta_recurrent(q, k, v, inputs.g, inputs.beta, views.ssm, p.read_slots,
                                     inputs.meta.batch.cu_seqlens, scale=c.scale, use_qk_l2norm=True)
        return RecurrentOutput(o=o, replay=replay), None
    mixed, windows = _conv(spec, views, inputs, p, per_token=True)  # [T, C], [T, C, W - 1]
    q, k, v = _split(spec, mixed)
    o, states = _recurrent(spec, views, inputs, p, q, k, v, per_token=True)  # [T, H, V], [T, H, K, V] | None
    return RecurrentOutput(o=o, replay=replay), _write(states, windows)


def supports(spec, device) -> list[str]:
    c = spec.config
    reasons = needs_cuda(device) + package_missing("triton") + needs_dtype(spec, _DTYPES)
    if c.head_k_dim > 256:
        reasons.append(f"head_k_dim={c.head_k_dim} > 256")
    if c.head_v_dim > 512:
        reasons.append(f"head_v_dim={c.head_v_dim} > 512")
    return reasons


# ------------------------------------------------------------------ fla-core


@functools.cache
def _fla_import_error() -> str | None:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to refuse, not to crash
        return f"fla-core does not import: {type(e).__name__}: {e}"
    return None


def fla_supports(spec, device) -> list[str]:
    c = spec.config
    reasons = needs_cuda(device) + package_missing("fla") + needs_dtype(spec, _DTYPES)
    if c.head_k_dim > 256 or c.head_v_dim > 256:
        reasons.append(f"head dims K={c.head_k_dim}, V={c.head_v_dim}: fla-core takes <= 256")
    if not reasons and _fla_import_error():  # importing fla only where it could run
        reasons.append(_fla_import_error())
    return reasons


def _fla_prefill(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    check_inputs(spec, inputs)
    c, p = spec.config, _plan_of(spec, inputs)
    split = _qkv_channels(spec) if _QKV_APART[-1] else None
    mixed, windows = _conv(spec, views, inputs, p, per_token=False, split=split)  # [T, C], [B, C, W - 1]
    q, k, v = _split(spec, mixed)
    # fla-core takes dense initial states, one per request, not a pool and slots: gather
    # them, and zero fresh requests (masked_fill, so a NaN in a stale slot cannot leak).
    # (the rows and the mask come from the plan: once a step, not once a layer)
    h0 = views.ssm.index_select(0, p.start_rows).float().masked_fill(p.fresh, 0.0)  # [B, H, K, V]
    forward = _fla_gdn_forward() if _FLA_DIRECT[-1] and spec.kind == "gdn" and p.fla_chunks is not None else None
    if forward is not None and not any(t.requires_grad for t in (q, k, v, inputs.g, inputs.beta)):
        o, final = forward(q[None], k[None], v[None], inputs.g[None], inputs.beta[None], c.scale, h0,
                           p.cu_seqlens_long, p.fla_chunks)
    else:
        op = chunk_gated_delta_rule if spec.kind == "gdn" else chunk_kda
        chunks = dict(chunk_indices=p.fla_chunks) if spec.kind == "gdn" else {}  # (the padded list of a bucket)
        o, final = op(q[None], k[None], v[None], inputs.g[None], inputs.beta[None], scale=c.scale, initial_state=h0,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=p.cu_seqlens_long,
                      cu_seqlens_cpu=p.cu_seqlens_cpu, **chunks)  # [1, T, H, V], [B, H, K, V] fp32
    return RecurrentOutput(o=o[0].to(spec.dtype)), _write(final.to(c.state_dtype), windows)


@functools.cache
def _fla_gdn_forward():
    """fla-core's GDN chunk forward without the wrappers of its public `chunk_gated_delta_rule` (an autograd
    Function, autocast, its backend dispatch, the input guard): at a prefill of 8192 tokens the step is
    bound by host time, and those layers took ~a third of the host time of each GDN layer's call. The same
    kernels run in the same order: l2norm of q and k, then `chunk_gated_delta_rule_fwd`. None when this
    fla-core's forward is not in the form this knows (its public function then runs)."""
    import contextlib
    import inspect

    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError:
        return None
    wanted = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
              "chunk_indices", "chunk_size"}
    if not wanted <= set(inspect.signature(chunk_gated_delta_rule_fwd).parameters):
        return None

    def forward(q, k, v, g, beta, scale, h0, cu_seqlens, chunk_indices):
        # the public function's input guard: contiguous inputs (q / k / v are column slices of the conv output)
        q, k, v, g, beta, h0 = (t.contiguous() for t in (q, k, v, g, beta, h0))
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # the guard's device
            out = chunk_gated_delta_rule_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
                                             output_final_state=True, cu_seqlens=cu_seqlens,
                                             chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE)
        return out[1], out[3]  # (g, o, A, final_state, ...): o [1, T, H, V], final_state [B, H, K, V]

    return forward


_guards = {}
for _kind in ("gdn", "kda"):
    _guards["_prefill"] = register(_kind, "prefill", "triton", supports=supports, plan=plan,
                                   invariant=True)(_prefill)
    _guards["_decode"] = register(_kind, "decode", "triton", supports=supports, plan=plan, capturable=True,
                                  invariant=True)(_decode)
    _guards["_verify"] = register(_kind, "verify", "triton", supports=supports, plan=plan, capturable=True,
                                  invariant=True)(_verify)
    # GDN's: in a bucket its launches are shaped by the bucket (`static_plan`), so a prefill graph holds it
    _guards["_fla_prefill"] = register(_kind, "prefill", "fla", supports=fla_supports,
                                       plan=static_plan if _kind == "gdn" else plan,
                                       capturable=_kind == "gdn")(_fla_prefill)
# The module's names run only through a session from here on, like every registered backend.
_prefill, _decode, _verify, _fla_prefill = (_guards[n] for n in ("_prefill", "_decode", "_verify", "_fla_prefill"))
