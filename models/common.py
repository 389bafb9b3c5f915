"""Pieces every model family shares: the token check, norms, rotary embeddings, MLPs, routed experts.

Plain functions of tensors; weights are passed in. fp32 statistics, results in
the activation dtype, matching the Hugging Face modules they stand in for.
The norm and rope live in `models.norm_rope` (which `models.fused`'s torch bodies
also use) and are re-exported here, where the families import them from; the
MLPs run their projections through `models.fused.linear`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fnattn.kernels.invariant import invariant_on, pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import checks, switches
from fnattn.checks import fail
from fnattn.lanes import in_static_step

from .fused import linear
from .norm_rope import apply_rope as apply_rope  # re-exported (`X as X`): the families import these from here
from .norm_rope import llama3_inv_freq as llama3_inv_freq
from .norm_rope import rms_norm as rms_norm
from .norm_rope import rope_cos_sin as rope_cos_sin
from .norm_rope import rope_inv_freq as rope_inv_freq
from .norm_rope import row_linear


def check_tokens(owner: str, tokens: Int[Tensor, " T"], vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``tokens`` unless every id is in ``0..vocab_size - 1``.

    An embedding lookup would read row ``-1`` (the last one) silently and fail
    with an IndexError past the end. On CPU the check always runs; tokens on a
    GPU are read back to the host only with ``FNATTN_CHECKS=1`` and never while
    a CUDA graph is being captured (a host read would break the capture and
    sync every step).
    """
    if tokens.device.type != "cpu":
        if not checks.CHECKS_ENABLED:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
    if tokens.numel() == 0 or in_static_step():  # a step runner checks its token lane before it copies it
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        fail(owner, "tokens", f"ids in 0..{vocab_size - 1}", lo if lo < 0 else hi)


def check_step_tokens(owner: str, batch, tokens: Int[Tensor, " T"], vocab_size: int) -> None:
    """A step's tokens: one per new token of its batch, each id in the vocabulary (`check_tokens`)."""
    if tokens.shape[0] != batch.num_tokens:
        fail(owner, "tokens", f"{batch.num_tokens} tokens (the batch's)", tokens.shape[0])
    check_tokens(owner, tokens, vocab_size)


REQUIRED = object()  # `config_field`'s default: the field must be present


def check_config_value(where: str, name: str, value, kind: type, *, minimum=None, above=None):
    """``value`` checked to be a ``kind`` (int, float, bool, str) and in range; ``-> value`` (floats as float).

    The one check of config.json values every family's adapter uses: ints are
    never bools or floats, floats take ints but must be finite (NaN / inf
    refused), ``minimum`` is inclusive and ``above`` exclusive. Errors are
    ``ValueError("{where}: `{name}` must be ..., got ...")``.
    """
    what = {int: "an int", float: "a finite number", bool: "true or false", str: "a string"}[kind]
    what += f" >= {minimum}" if minimum is not None else ""
    what += f" > {above}" if above is not None else ""
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    ok = ok and not (kind is float and not math.isfinite(value))
    ok = ok and (minimum is None or value >= minimum) and (above is None or value > above)
    if not ok:
        fail(where, name, what, value)
    return value


def config_field(d: dict, where: str, name: str, kind: type, default=REQUIRED, *, minimum=None, above=None):
    """``d[name]`` checked by `check_config_value`; absent (or null, when there is a default): ``default``."""
    if name not in d or (d[name] is None and default is not REQUIRED):
        if default is REQUIRED:
            fail(where, name, f"present ({'an' if kind is int else 'a'} {kind.__name__})", None)
        return default
    return check_config_value(where, name, d[name], kind, minimum=minimum, above=above)


def logit_rows(batch, hidden: Float[Tensor, "T D"]) -> Float[Tensor, "Tl D"]:
    """The rows of ``hidden`` a step computes logits for: every token's, or with ``batch.logits_for ==
    "last"`` each request's last new token's ``[B, D]`` (a device gather: no host read, fixed shape)."""
    if batch.logits_for == "all" or batch.num_tokens == batch.num_requests:
        return hidden
    return hidden.index_select(0, batch.cu_seqlens[1:].long() - 1)


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with [out, in] weights (`fused.linear`: decode sizes on one kernel each)."""
    return linear(pointwise(F.silu, linear(x, gate)) * linear(x, up), down)


@dataclass(frozen=True, eq=False)
class SwiGLU:
    """A SwiGLU MLP's weights, as checkpoints name them under a prefix (``gate_proj``, ``up_proj``, ``down_proj``)."""

    gate: Tensor  # [I, D]
    up: Tensor  # [I, D]
    down: Tensor  # [D, I]

    @classmethod
    def take(cls, weights, prefix: str) -> SwiGLU:
        return cls(weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"],
                   weights[prefix + "down_proj.weight"])

    @staticmethod
    def shapes(prefix: str, D: int, inner: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_proj.weight": (inner, D), prefix + "up_proj.weight": (inner, D),
                prefix + "down_proj.weight": (D, inner)}

    def __call__(self, x: Tensor) -> Tensor:
        return swiglu(x, self.gate, self.up, self.down)


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """A MoE layer's routed experts as two stacked weights; ``experts[e]`` is expert e's `SwiGLU`, views of them.

    Stacked at load so a static-shape step can run the picked experts as grouped GEMMs (`grouped_moe`) while
    the eager loop calls each expert as before, on the same memory."""

    gate_up: Tensor  # [E, 2I, D]: expert e's gate rows, then its up rows
    down: Tensor  # [E, D, I]

    def __post_init__(self):
        E, I2, D = self.gate_up.shape
        if I2 % 2 or tuple(self.down.shape) != (E, D, I2 // 2):
            fail("StackedExperts", "down", f"shape {(E, D, I2 // 2)} (gate_up is {tuple(self.gate_up.shape)})",
                 tuple(self.down.shape))
        inner = I2 // 2
        each = tuple(SwiGLU(self.gate_up[e, :inner], self.gate_up[e, inner:], self.down[e]) for e in range(E))
        object.__setattr__(self, "_each", each)  # not a field: the weights are the two stacked tensors

    @classmethod
    def stack(cls, experts: Sequence[tuple[Tensor, Tensor, Tensor]]) -> StackedExperts:
        """From each expert's ``(gate [I, D], up [I, D], down [D, I])``, copied into the stacked weights."""
        g0, _, d0 = experts[0]
        gate_up = g0.new_empty(len(experts), 2 * g0.shape[0], g0.shape[1])
        down = d0.new_empty(len(experts), *d0.shape)
        for e, (g, u, d) in enumerate(experts):
            gate_up[e, :g0.shape[0]].copy_(g)
            gate_up[e, g0.shape[0]:].copy_(u)
            down[e].copy_(d)
        return cls(gate_up, down)

    @classmethod
    def take(cls, weights, prefix: str, count: int) -> StackedExperts:
        """Experts ``{prefix}{e}.`` for e < ``count``, each named as `SwiGLU.take` reads it, stacked."""
        return cls.stack([(s.gate, s.up, s.down) for s in (SwiGLU.take(weights, f"{prefix}{e}.")
                                                           for e in range(count))])

    def __len__(self) -> int:
        return len(self._each)

    def __getitem__(self, e: int) -> SwiGLU:
        return self._each[e]


GROUPED_TOKENS = 4096  # tokens a `grouped_moe` pass takes: a long prefill's pair buffers stay bounded


def grouped_moe(
    x: Float[Tensor, "T D"],
    ids: Int[Tensor, "T k"],
    weights: Float[Tensor, "T k"],
    gate_up: Float[Tensor, "E I2 D"],
    down: Float[Tensor, "E D I"],
    combine: Callable[[Tensor, Tensor], Tensor],
    *,
    limit: float | None = None,
) -> Float[Tensor, "T D"]:
    """`moe_sum` of SwiGLU experts without a host read: the (token, expert) pairs sorted by expert, two grouped
    GEMMs over the stacked weights (each group one expert's pairs, its end found on the device), then each
    token's k weighted outputs summed in one reduction (fp32 accumulation, one rounding to ``x.dtype``): about
    fifteen launches a layer whatever k is. Past `GROUPED_TOKENS` tokens (a long prefill) the tokens go in
    passes of that many, so the [tokens x k, D] buffers of a pass stay bounded (a decode step is one pass)."""
    T = ids.shape[0]
    if T > GROUPED_TOKENS:
        return _in_passes(grouped_moe, x, ids, weights, gate_up, down, combine, limit)
    k, E = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1)  # [P]: pair p = t * k + j
    picked, order = flat.sort(stable=True)  # the pairs grouped by expert, tokens in order within one
    every = torch.arange(E, device=x.device, dtype=picked.dtype)
    ends = torch.searchsorted(picked, every, right=True).to(torch.int32)  # [E]: one past each expert's last pair
    h = torch._grouped_mm(x.index_select(0, order // k), gate_up.transpose(1, 2), offs=ends)  # [P, 2I]
    g, u = h.chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=ends)  # [P, D]
    y = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)  # back in pair order (each row once)
    return combine(y, weights[..., None]).sum(1).to(x.dtype)  # [T, D]: summed in fp32, then rounded once


def _in_passes(moe: Callable, x, ids, weights, gate_up, down, combine, limit) -> Tensor:
    """``moe`` over passes of `GROUPED_TOKENS` tokens, concatenated: a long prefill's [tokens x k, D] pair
    buffers stay bounded."""
    step = GROUPED_TOKENS
    return torch.cat([moe(x[i:i + step], ids[i:i + step], weights[i:i + step], gate_up, down, combine, limit=limit)
                      for i in range(0, ids.shape[0], step)])


def invariant_moe(
    x: Float[Tensor, "T D"],
    ids: Int[Tensor, "T k"],
    weights: Float[Tensor, "T k"],
    gate_up: Float[Tensor, "E I2 D"],
    down: Float[Tensor, "E D I"],
    combine: Callable[[Tensor, Tensor], Tensor],
    *,
    limit: float | None = None,
) -> Float[Tensor, "T D"]:
    """`grouped_moe` in the invariant mode on CUDA: every (token, expert) pair's two products are the bits
    `row_linear` gives that token alone (`kernels.invariant_linear.invariant_grouped_linear`: fixed 16-row
    tiles, one expert each, K summed in fixed chunks), and each token's k weighted outputs are added in fp32 in
    its own slot order, one add per slot, then rounded once: nothing a token gets depends on the other tokens or
    on how they routed. Only the picked experts' weights are read, with no host read (a captured step's grid is
    bounded by the pair and expert counts), where the mode's every-expert loop read all of them."""
    from fnattn.kernels.invariant_linear import expert_tiles, invariant_grouped_linear

    T, k = ids.shape
    if T > GROUPED_TOKENS:  # a token's rows never depend on the pass
        return _in_passes(invariant_moe, x, ids, weights, gate_up, down, combine, limit)
    picked, order = ids.reshape(-1).sort(stable=True)  # [P]: the pairs grouped by expert
    tiles = expert_tiles(picked, gate_up.shape[0])
    h = invariant_grouped_linear(x, gate_up, tiles, order // k)  # [P, 2I], sorted pairs
    g, u = h.chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    y = invariant_grouped_linear(pointwise(F.silu, g) * u, down, tiles)  # [P, D], sorted pairs
    y = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)  # pair order: token t's slots t*k .. t*k+k-1
    weighted = combine(y, weights[..., None])  # [T, k, D]
    out = weighted[:, 0].float()
    for j in range(1, k):  # elementwise adds: a reduction's order could follow T
        out = out + weighted[:, j].float()
    return out.to(x.dtype)


def _invariant_grouped(x: Tensor, gate_up: Tensor | None, down: Tensor | None) -> bool:
    """Whether a MoE layer takes `invariant_moe`: the invariant mode on CUDA, stacked weights of x's dtype whose
    experts' rows are contiguous (the grouped kernel's layout)."""
    if gate_up is None or down is None or not (invariant_on() and x.is_cuda and switches.value("grouped_experts")):
        return False
    return (gate_up.dtype == down.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and gate_up.stride(-1) == down.stride(-1) == 1 and gate_up.stride(1) == gate_up.shape[2]
            and down.stride(1) == down.shape[2])


def _stacked_moe(x: Tensor, gate_up: Tensor, down: Tensor) -> Callable | None:
    """The form over stacked weights a MoE layer takes (`grouped_moe` where `_grouped`, `invariant_moe` where
    `_invariant_grouped`), or None: the loop over the picked experts, or every expert in a static step."""
    if _grouped(x, down):
        return grouped_moe
    if _invariant_grouped(x, gate_up, down):
        return invariant_moe
    return None


def _grouped(x: Tensor, down: Tensor | None) -> bool:
    """Whether a MoE layer takes `grouped_moe` (`fused.grouped_experts`, on by default): on CUDA every step,
    eager or static, in bf16 with rows of 16-byte multiples (what CUDA's grouped GEMM takes), so no step reads
    the routing back to the host; on a CPU a static-shape step in any float dtype, while the eager step keeps
    the loop over the picked experts (no device to wait for there, and the loop is the plain reading). Never in
    the invariant mode: a grouped GEMM's rows follow its groups' sizes (there CUDA takes `invariant_moe`; a CPU
    the loop and the static step's every-expert form, which sum a token's experts in the same order, each row
    its own product: `models.norm_rope.row_linear`)."""
    if down is None or not switches.value("grouped_experts") or invariant_on():
        return False
    if not x.is_cuda:
        return in_static_step() and x.dtype.is_floating_point
    D, inner = x.shape[-1], down.shape[-1]
    return x.dtype is torch.bfloat16 and D % 8 == 0 and inner % 8 == 0


_LAYER_RANGES: list[bool] = []  # one entry per open `layer_ranges` block


@contextlib.contextmanager
def layer_ranges() -> Iterator[None]:
    """Within this block `each_layer` wraps each layer's work in a profiler range named ``fnattn layer {i}``,
    so a profile can charge each kernel to its layer (the model bench's time against bytes). Eager steps only:
    a graph replay runs no Python."""
    _LAYER_RANGES.append(True)
    try:
        yield
    finally:
        _LAYER_RANGES.pop()


def each_layer(layers: Sequence) -> Iterator[tuple[int, object]]:
    """``enumerate(layers)``; inside `layer_ranges`, the loop body of each layer runs in its range."""
    if not _LAYER_RANGES:
        yield from enumerate(layers)
        return
    for i, layer in enumerate(layers):
        # the generator stays suspended inside the range while the caller's loop body runs
        with torch.profiler.record_function(f"fnattn layer {i}"):
            yield i, layer


_ROUTED_COUNTS: list[list[int]] = []  # innermost `counting_routed_experts` block last


@contextlib.contextmanager
def counting_routed_experts() -> Iterator[list[int]]:
    """Within this block each MoE layer call appends how many distinct experts its tokens picked, in call order:
    what a step's routed experts really read (a bench's roofline). Each count reads the routing back to the
    host, so this is for an untimed, uncaptured step only."""
    counts: list[int] = []
    _ROUTED_COUNTS.append(counts)
    try:
        yield counts
    finally:
        _ROUTED_COUNTS.remove(counts)


def _count_routed(ids: Tensor) -> None:
    if _ROUTED_COUNTS:
        _ROUTED_COUNTS[-1].append(int(ids.unique().numel()))


def experts(
    x: Float[Tensor, "T D"],
    top_ids: Int[Tensor, "T k"],
    top_weights: Float[Tensor, "T k"],
    gate_up: Float[Tensor, "E I2 D"],
    down: Float[Tensor, "E D I"],
    *,
    limit: float | None = None,
) -> Float[Tensor, "T D"]:
    """Routed experts with fused ``gate_up`` [E, 2I, D] and ``down`` [E, D, I] weights.

    Each token's chosen experts run on that token only; their outputs are
    weighted and summed (in the activation dtype, as the HF modules do).
    ``limit`` clips the pre-activations (gate above, up both ways; DeepSeek-V4's ``swiglu_limit``).
    """
    def run(e, xs):
        g, u = row_linear(xs, gate_up[e]).chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return row_linear(pointwise(F.silu, g) * u, down[e])

    def combine(y, w):
        return y * w.to(y.dtype)

    moe = _stacked_moe(x, gate_up, down)
    if moe is not None:
        _count_routed(top_ids)
        return moe(x, top_ids, top_weights, gate_up, down, combine, limit=limit)
    return moe_sum(x, top_ids, top_weights, gate_up.shape[0], run, combine)


def moe_sum(
    x: Float[Tensor, "T D"],
    ids: Int[Tensor, "T k"],
    weights: Float[Tensor, "T k"],
    num_experts: int,
    run: Callable[[int, Tensor], Tensor],
    combine: Callable[[Tensor, Tensor], Tensor],
    stacked: StackedExperts | None = None,
) -> Float[Tensor, "T D"]:
    """``sum_k combine(run(ids[t, k], x[t]), weights[t, k])`` per token (a token picks an expert at most once).

    With the experts' ``stacked`` weights and `fused.grouped_experts` on (the default), it is `grouped_moe`
    wherever `_grouped` says so: every CUDA bf16 step, and a CPU static-shape step; in the invariant mode on
    CUDA it is `invariant_moe`, every step, eager or static. Otherwise, eager, each
    expert runs on the tokens that chose it (reading the routing back to the host); inside a static-shape step
    (`fnattn.lanes.static_shapes`: a captured or capturable step) every expert runs on every token with a
    weight that is zero where the token did not choose it: no host read, shapes fixed by the bucket, at
    ``num_experts`` times the expert FLOPs.
    """
    _count_routed(ids)
    moe = None if stacked is None else _stacked_moe(x, stacked.gate_up, stacked.down)
    if moe is not None:
        return moe(x, ids, weights, stacked.gate_up, stacked.down, combine)
    out = torch.zeros_like(x)
    if in_static_step():
        for e in range(num_experts):
            w = (weights * (ids == e)).sum(-1, keepdim=True)  # [T, 1]: the token's weight for e, or 0
            out = out + combine(run(e, x), w).to(x.dtype)
        return out
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        out.index_add_(0, tok, combine(run(e, x[tok]), weights[tok, slot, None]).to(x.dtype))
    return out


def softmax_topk(logits: Float[Tensor, "T E"], k: int, *, normalize: bool) -> tuple[Tensor, Tensor]:
    """Qwen-style routing: softmax over experts, top-k, optionally renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def grouped_topk(
    scores: Float[Tensor, "T E"],
    bias: Float[Tensor, " E"] | None,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing: pick ``topk_group`` of ``n_group`` expert groups by the sum
    of each group's best two biased scores, then the top-k experts inside them.
    Weights come from the unbiased scores."""
    T, E = scores.shape
    biased = scores if bias is None else scores + bias[None, :]
    group_scores = biased.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, keep_groups, 1.0)
    expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    # -inf, not 0: a kept expert's biased score may be negative and must still beat
    # every expert of a dropped group (transformers' routers mask with -inf).
    ids = biased.masked_fill(expert_mask == 0, float("-inf")).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scaling
