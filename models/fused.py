"""Fused model pieces: one kernel where the plain torch form launches several.

Each function has two bodies with one contract: on a CUDA tensor in bf16 / fp16
(with the kernel's package installed) it calls FlashInfer's, fla-core's or
fnattn's own Triton kernel; otherwise it runs the unfused torch math of
`models.norm_rope` (or ``F.linear``), which is also what `unfused()` forces for
parity checks. The torch bodies are the truth; the kernels agree with them to
bf16 rounding (tests/gpu/test_fused_gpu.py).

`linear` takes decode-sized inputs (at most 16 rows) to `fnattn.kernels.skinny_linear`,
which streams the weight once; larger inputs stay on ``F.linear``. On the H200 at one
row it is 1.02-1.05x cuBLAS on the wide projections and the lm_head and 1.3-2.3x on the
narrow ones cuBLAS runs with split-K (`fnattn bench linear`); at 32 rows cuBLAS's tiles
win. Its ``residual=`` (added to the fp32 product) and ``norm=`` (RMSNorm of the input on
load) let the kernel take a residual-add + RMSNorm between two projections into them.
The kernel's SiLU-and-mul prologue is slower than `silu_and_mul` then the GEMV (10.4 us
against 7.8 us for the 0.8B MLP's down projection), so the models do not use it; they take the
activation into the gate / up projection's epilogue instead (`gate_up_silu`, `swiglu_epilogue`).
`gdn_gating` computes GDN's g and beta in one launch (`fnattn.kernels.gdn_gating`). `project_add_norm` with
``split=True`` (`split_norm`, on) splits a residual add + RMSNorm between the GEMVs on either side of it
(`SplitNorm`): no launch of its own at decode sizes. A mixer's output gate stays a launch of its own before
the output projection (`gated_projection`): applied in that GEMV as it loaded x, every program repeated the
norm before its first weight load, and the Qwen3.5-0.8B step on the H200 took 1.02x as long.

In the invariant mode (`fnattn.kernels.invariant`) only fnattn's own kernels stay (`_kernel_rule`): each launch
is shaped by a row's width, so a row's bits do not follow the number of rows, and `linear` takes any number of
rows to the GEMV, whose launch the mode fixes by the weight's shape. FlashInfer's and fla's kernels give way to
the torch bodies there.

Where fp32 stays in a bf16 model, the math needs it: RMSNorm statistics (inside
the kernels), the rope angles (one fp32 table per step, shared by every layer),
GDN's log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``, which the
recurrence takes in fp32, and the logits, which a step returns in fp32 (one
cast of ``[T, vocab]`` per step). Nothing else is cast: attention inputs and
outputs, gates and residuals stay in the model's dtype.

Functions whose names end in ``_`` write into their arguments (as torch's
in-place ops do); a model passes them only tensors the step itself made.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from fnattn.kernels._checks import shares_storage
from fnattn.kernels.invariant import invariant_on, pointwise, row_aligned
from jaxtyping import Float
from torch import Tensor

from fnattn import switches as registry
from fnattn.switches import declare, switched
from fnattn.tp import all_reduce, current

from .norm_rope import apply_rope, rms_norm, row_linear

# The figures are ``benchmarks/model_ab.py``'s, the variants' steps interleaved.
_ENABLED = declare(
    "fused", True, __name__,
    on="each function here calls its kernel where one serves (CUDA, bf16 / fp16, the package installed)",
    off="every function runs its torch body (`unfused()`)",
    why="the torch bodies are the truth the kernels are checked against: parity tests run them")
_QK_ONE_LAUNCH = declare(
    "qk_one_launch", True, __name__,
    on="`qk_norm_rope` runs `fnattn.kernels.qk_norm_rope` on CUDA: q / k norms, rope and v's copy in one launch",
    off="FlashInfer's norms and rope (and the copies)",
    why="off, the Qwen3.5-0.8B graph step (H200) took 1.03x / 1.06x as long at batch 1 / 8")
_OUTPUT_GATES = declare(
    "output_gates", True, __name__,
    on="`gated_rms_norm_silu` and `sigmoid_gate` run `fnattn.kernels.output_gate` on CUDA: one PDL launch each, "
       "the gate read in place",
    off="fla's gated norm and the torch gate",
    why="on, the Qwen3.5-0.8B graph step (H200) took 0.958x / 0.945x as long at batch 1 / 8")
_OWN_NORM_ACT = declare(
    "own_norm_act", True, __name__,
    on="`add_rms_norm_offset_` and `silu_and_mul` run `fnattn.kernels.norm_act` on CUDA, which hand the stream "
       "to the next launch as they start",
    off="FlashInfer's kernels, which hand it over at their end",
    why="on, the Qwen3.5-0.8B graph step (H200) took 0.952x / 0.958x as long at batch 1 / 8")
_GATING_EPILOGUE = declare(
    "gating_epilogue", True, __name__,
    on="`project_and_gate` takes decode-sized CUDA inputs to one launch: GDN's g and beta written by the GEMV",
    off="the GEMV, then `gdn_gating`",
    why="on, the Qwen3.5-0.8B graph step (H200) took 0.983x / 0.988x as long at batch 1 / 8")
_SWIGLU_EPILOGUE = declare(
    "swiglu_epilogue", True, __name__,
    on="`gate_up_silu` takes decode-sized CUDA inputs to one launch: the gate / up GEMV writes silu(gate) * up",
    off="the GEMV, then `silu_and_mul`",
    why="on, the Qwen3.5-0.8B graph step (H200) took 0.970x / 0.979x as long at batch 1 / 8")
_GROUPED_EXPERTS = declare(
    "grouped_experts", True, __name__,
    on="a MoE layer's routed experts run as two grouped GEMMs over the picked experts (`common.grouped_moe`; in "
       "the invariant mode on CUDA the fixed-tile grouped kernel, `common.invariant_moe`)",
    off="a captured step runs every expert on every token; an eager one loops over the picked experts",
    why="on, DeepSeek-V3.2's 2-layer graph step on the H200 took 0.154x / 0.192x / 0.219x as long at batch "
        "1 / 8 / 32; the loop is the plain reading")
_SPLIT_NORM = declare(
    "split_norm", True, __name__,
    on="`project_add_norm(split=True)` leaves the next RMSNorm to the GEMVs on either side of it (`SplitNorm`)",
    off="the residual add + RMSNorm a launch of its own",
    why="on, the Qwen3.5-0.8B graph step (H200) took 0.974x / 0.988x as long at batch 1 / 8; the norm's "
        "rounding moves to the product (bf16 agreement)")


def unfused():
    """Within this block every function here runs its torch body (the reference for parity tests)."""
    return switched(_ENABLED, "unfused", False)


def qk_one_launch(enabled: bool):
    """Within this block `qk_norm_rope` runs `fnattn.kernels.qk_norm_rope` on CUDA when ``enabled`` (the
    default), else FlashInfer's norms and rope. On by default: off, the whole Qwen3.5-0.8B graph step on the
    H200 took 1.03x as long at batch 1 and 1.06x at batch 8 (``benchmarks/model_ab.py``, the variants' steps
    interleaved: benchmarks/results/bench_switches_ab_dd3d3d6.json)."""
    return switched(_QK_ONE_LAUNCH, "qk_one_launch", enabled)


def output_gates(enabled: bool):
    """Within this block `gated_rms_norm_silu` and `sigmoid_gate` run `fnattn.kernels.output_gate` on CUDA
    when ``enabled``: one launch each, the gate read where the projection left it (no copy to contiguous),
    launched with PDL, so the output projection after them can start loading its weights. On by default:
    on, the whole Qwen3.5-0.8B graph step on the H200 took 0.958x as long at batch 1 and 0.945x at batch 8
    (``benchmarks/model_ab.py --toggle output_gates``, benchmarks/results/bench_switches_ab.json)."""
    return switched(_OUTPUT_GATES, "output_gates", enabled)


def own_norm_act(enabled: bool):
    """Within this block `add_rms_norm_offset_` and `silu_and_mul` run `fnattn.kernels.norm_act` on CUDA
    when ``enabled``, in place of FlashInfer's: kernels that, launched with PDL, hand the stream over right
    after they start (FlashInfer's do at their end), so the GEMV after each can launch and stream its
    weights while they run. On by default: on, the whole Qwen3.5-0.8B graph step on the H200 took 0.952x as
    long at batch 1 and 0.958x at batch 8 (``benchmarks/model_ab.py --toggle own_norm_act``)."""
    return switched(_OWN_NORM_ACT, "own_norm_act", enabled)


def gating_epilogue(enabled: bool):
    """Within this block `project_and_gate` takes decode-sized inputs on CUDA to one launch
    (`skinny_linear_gating`: GDN's g and beta written by the GEMV tile that holds the b and a columns)
    when ``enabled``. On by default: on, the whole Qwen3.5-0.8B graph step on the H200 took 0.983x as long
    at batch 1 and 0.988x at batch 8 (``benchmarks/model_ab.py --toggle gating_epilogue``)."""
    return switched(_GATING_EPILOGUE, "gating_epilogue", enabled)


def swiglu_epilogue(enabled: bool):
    """Within this block `gate_up_silu` takes decode-sized inputs on CUDA to one launch
    (`skinny_linear_swiglu`: each column tile of the gate / up GEMV writes ``silu(gate) * up`` of its
    columns) when ``enabled``, in place of the GEMV then `silu_and_mul`. On by default: on, the whole
    Qwen3.5-0.8B graph step on the H200 took 0.970x as long at batch 1 and 0.979x at batch 8
    (``benchmarks/model_ab.py --toggle swiglu_epilogue``, benchmarks/results/bench_epilogues_ab.json)."""
    return switched(_SWIGLU_EPILOGUE, "swiglu_epilogue", enabled)


def grouped_experts(enabled: bool):
    """Within this block a MoE layer's routed experts run as two grouped GEMMs over the experts its tokens
    picked (`common.grouped_moe`: ``torch._grouped_mm`` over the weights stacked at load, the groups found on
    the device, a token's k outputs summed in one fp32 reduction) when ``enabled``: on CUDA in every bf16 step,
    eager or captured, and on a CPU in static-shape steps (`common._grouped`); in the invariant mode on CUDA as
    fixed-tile grouped products whose every row is the bits of that token alone (`common.invariant_moe`). Off,
    a captured step runs every
    expert on every token with a zero weight and an eager one loops over the picked experts, reading the
    routing back to the host and adding each expert's outputs in turn. On by default: on, DeepSeek-V3.2's
    2-layer graph step at its released shape on the H200 took 0.154x / 0.192x / 0.219x as long at batch 1 / 8 /
    32, paired by round (``benchmarks/model_ab.py --family deepseek_v32 --shape 2-layer --ctx 2048 --toggle
    grouped_experts``, benchmarks/results/bench_grouped_experts_ab.json at 41e6c56)."""
    return switched(_GROUPED_EXPERTS, "grouped_experts", enabled)


def split_norm(enabled: bool):
    """Within this block `project_add_norm(..., split=True)` takes decode-sized inputs on CUDA (without TP)
    to `skinny_linear_add_`: the output projection's GEMV adds into the residual stream itself and leaves the
    parts of the next RMSNorm that need no whole row (each column tile's sums of squares, the rows times
    ``1 + weight``); the next projection's GEMV streams those rows into its dots as loaded and scales
    each row of its product by the rms (`SplitNorm`): the residual add + RMSNorm launch between them is gone.
    The norm's rounding moves from the normed rows to the product, so the two agree to bf16 rounding. On by
    default: on, the whole Qwen3.5-0.8B graph step on the H200 took 0.974x as long at batch 1 and 0.988x at
    batch 8 (``benchmarks/model_ab.py --toggle split_norm``, benchmarks/results/bench_split_norm_ab.json at
    6ce2fb6). A first form (07f1fd9) normalized x as each K tile loaded, which took x off the dots' async
    pipeline: 1.134x / 1.128x the step (bench_norm_on_load_ab_07f1fd9.json)."""
    return switched(_SPLIT_NORM, "split_norm", enabled)


@dataclass(frozen=True, eq=False)
class SplitNorm:
    """``rms_norm_offset(x, weight, eps)`` (Qwen's ``1 + weight`` norm) split between two GEMVs: what the add's
    GEMV left of it, for the GEMV that reads it.

    `project_add_norm` returns one under `split_norm`; `linear`, `project_and_gate` and `gate_up_silu` take
    ``scaled`` into their dots and scale their product's rows by the rms of ``squares`` (`skinny_linear`'s
    ``rms=``); anything else takes `tensor()`. Read it before the residual stream's next in-place add: ``x``
    is that stream.
    """

    x: Tensor  # [T, D], the residual stream as the add left it
    scaled: Tensor  # [T, D]: x * (1 + weight), rounded to x's dtype
    squares: Tensor  # [T, P] fp32: sums of squares of x's column pieces (row sums: x's sums of squares)
    weight: Tensor  # [D], stored as weight - 1
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def rms(self) -> tuple[Tensor, float]:
        return self.squares, self.eps

    def tensor(self) -> Tensor:
        """The normalized rows (a launch of their own)."""
        return rms_norm_offset(self.x, self.weight, self.eps)


def switches() -> dict[str, bool]:
    """Which way each switch declared here stands now (`fnattn.switches.snapshot` has every module's)."""
    return {name: registry.value(name) for name, s in registry.switches().items() if s.module == __name__}


def _takes_split(x, w: Tensor) -> bool:
    """Whether ``x`` is a `SplitNorm` whose rest the GEMV of ``x.scaled @ w.T`` can finish."""
    return isinstance(x, SplitNorm) and x.scaled.dim() == 2 and _skinny(x.scaled, w, w.shape[-1])


@cache
def _own(module: str):
    """``fnattn.kernels.<module>``, imported on first use (the torch bodies need none, and Triton loads with
    them); cached because a decode step asks ~150 times, and an import statement costs microseconds each time."""
    return importlib.import_module(f"fnattn.kernels.{module}")


@cache
def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _kernel(package: str, *tensors: Tensor) -> bool:
    """Whether the kernel path applies: CUDA (``is_cuda``: no device object a call) and `_kernel_rule`."""
    return tensors[0].is_cuda and _kernel_rule(package, *tensors)


def _kernel_rule(package: str, *tensors: Tensor) -> bool:
    """`_kernel` but its device: enabled, half precision, one dtype, package installed, and in the invariant mode
    fnattn's own kernels only (``"triton"``), which honour it: each launch is shaped by the row's width alone (a
    row per program for the norms, elementwise for gates and activations; the GEMV's launch in the mode is fixed
    by the weight's shape), so a row's bits do not follow the number of rows. FlashInfer's and fla's are not
    checked to. The torch bodies honour it too."""
    if not _ENABLED[-1] or (invariant_on() and package != "triton"):
        return False
    dtype = tensors[0].dtype
    if dtype != torch.bfloat16 and dtype != torch.float16:
        return False
    for t in tensors:  # a loop, not all() over a generator: asked before every launch of an eager step
        if t.dtype != dtype:
            return False
    return _installed(package)


def _rows_alike(x: Tensor, *others: Tensor) -> bool:
    """``others`` have ``x``'s shape, and all of them a unit stride along the last dim (what the own
    row kernels take; anything else runs the torch body)."""
    return all(t.shape == x.shape for t in others) and all(t.stride(-1) == 1 or t.shape[-1] <= 1
                                                            for t in (x, *others))


def rms_norm_offset(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(x, weight, eps, offset=1.0)`` (Qwen's ``1 + weight`` norm) over the last dim; any leading dims."""
    if _kernel("flashinfer", x, weight):
        import flashinfer

        shape = x.shape
        out = flashinfer.norm.gemma_rmsnorm(x.reshape(-1, shape[-1]), weight, eps)  # 2D rows, last dim contiguous
        return out.view(shape)
    return rms_norm(x, weight, eps, offset=1.0)


def add_rms_norm_offset_(y: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``-> (residual + y, rms_norm(residual + y, weight, eps, offset=1.0))``, both ``[T, D]``.

    With the kernel it is one launch that writes the sum into ``residual`` and
    the normed value into ``y`` (FlashInfer's gemma_fused_add_rmsnorm, which
    normalizes the fp32 sum before rounding it; the torch body normalizes the
    rounded sum).
    """
    if _OWN_NORM_ACT[-1] and y.dim() == 2 and _kernel("triton", y, residual, weight) \
            and _rows_alike(y, residual) \
            and weight.shape == y.shape[-1:] and not shares_storage(y, residual):
        return _own("norm_act").add_rms_norm_(y, residual, weight, eps, 1.0)  # the torch body's roundings
    if _kernel("flashinfer", y, residual, weight) and y.is_contiguous() and residual.is_contiguous():
        import flashinfer

        flashinfer.norm.gemma_fused_add_rmsnorm(y, residual, weight, eps)
        return residual, y
    x = residual + y
    return x, rms_norm(x, weight, eps, offset=1.0)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` along the last dim (``[T, 2I] -> [T, I]``)."""
    if _OWN_NORM_ACT[-1] and gate_up.dim() == 2 and gate_up.shape[-1] % 2 == 0 \
            and _kernel("triton", gate_up) and _rows_alike(gate_up):
        return _own("norm_act").silu_and_mul(gate_up)
    # The kernel loads 16-byte vectors: each row must be a whole number of them.
    if _kernel("flashinfer", gate_up) and gate_up.is_contiguous() and gate_up.shape[-1] * gate_up.element_size() % 16 \
            == 0:
        import flashinfer

        return flashinfer.activation.silu_and_mul(gate_up)
    g, u = gate_up.chunk(2, dim=-1)
    return pointwise(F.silu, g) * u


def rope_table(cos: Tensor, sin: Tensor) -> Tensor:
    """The per-step ``[T, Dr]`` fp32 table FlashInfer's rope reads: ``cat(cos[:, :Dr/2], sin[:, :Dr/2])``, row t
    for token t (so the kernel's positions are ``0..T-1``). Built once per step from `rope_cos_sin`'s output."""
    half = cos.shape[-1] // 2
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float().contiguous()


def step_rope_table(cos: Float[Tensor, "T Dr"], sin: Float[Tensor, "T Dr"], x: Float[Tensor, "T D"]
                    ) -> Float[Tensor, "T Dr"] | None:
    """The step's `rope_table` where its attention layers will read it: on CUDA, unless `qk_one_launch`'s
    kernel, which reads ``cos`` / ``sin`` themselves, takes activations like ``x`` (then None: a launch saved)."""
    if not cos.is_cuda or (_QK_ONE_LAUNCH[-1] and _kernel("triton", x)):
        return None
    return rope_table(cos, sin)


def _rope_kernel_fits(q: Tensor, table: Tensor) -> bool:
    """FlashInfer's rope kernel takes head dims 64..512 (powers of two) and loads ``vec`` lanes at a time, with
    ``vec = max(16 bytes, D / 32)``: each half of the rotary dims must be whole vectors."""
    D, Dr = q.shape[-1], table.shape[-1]
    vec = max(16 // q.element_size(), D // 32)
    return D in (64, 128, 256, 512) and Dr <= D and (Dr // 2) % vec == 0


def rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, table: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Rotate-half rope on the first ``Dr`` dims of ``q [T, Hq, D]`` and ``k [T, Hkv, D]``: ``-> (q, k)``.

    The kernel (FlashInfer's apply_rope_with_cos_sin_cache_inplace, reading
    `rope_table`) rotates ``q`` and ``k`` in place, both in one launch; they
    must be contiguous. The torch body is `norm_rope.apply_rope` (fp32 rotation,
    rounded once).
    """
    if table is not None and _rope_kernel_fits(q, table) and _kernel("flashinfer", q, k) and q.is_contiguous() \
            and k.is_contiguous():
        import flashinfer

        T, D = q.shape[0], q.shape[-1]
        positions = torch.arange(T, device=q.device, dtype=torch.int64)
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q.view(T, -1), k.view(T, -1), D, table,
                                                               is_neox=True)
        return q, k
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def gated_rms_norm_silu(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(x, weight) * silu(gate)`` over the last dim (GDN's output norm), in ``gate.dtype``.

    The kernel is fla-core's rms_norm_gated (statistics, weight and gate in
    fp32, one rounding); the torch body rounds the normed value before the
    gate, as transformers' module does.
    """
    x = x.to(gate.dtype)
    if _OUTPUT_GATES[-1] and x.dim() == 3 and _kernel("triton", x, gate, weight) \
            and _rows_alike(x, gate) and weight.shape == x.shape[-1:]:
        return _own("output_gate").gated_rms_norm_silu(x, gate, weight, eps)
    if _kernel("fla", x, gate, weight):
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)
    return (rms_norm(x, weight, eps) * pointwise(F.silu, gate.float())).to(x.dtype)


def sigmoid_gate(x: Float[Tensor, "T H D"], gate: Float[Tensor, "T H D"]) -> Float[Tensor, "T H D"]:
    """``x * sigmoid(gate)`` (gated attention's output gate), ``gate`` any strides but the last: two torch
    launches, or under `output_gates` on CUDA one (`fnattn.kernels.output_gate.sigmoid_gate`)."""
    if _OUTPUT_GATES[-1] and x.dim() == 3 and _kernel("triton", x, gate) \
            and _rows_alike(x, gate):
        return _own("output_gate").sigmoid_gate(x, gate)
    return x * pointwise(torch.sigmoid, gate)


_SKINNY_ROWS = 16  # measured: at 32 rows cuBLAS's GEMM tiles beat the kernel (skinny_linear itself takes 64)


def _skinny(x: Tensor, w: Tensor, width: int, residual: Tensor | None = None,
            norm: tuple[Tensor, float, float] | None = None) -> bool:
    """Whether `skinny_linear` takes ``x [..., width] @ w.T``: the kernel applies, at most `_SKINNY_ROWS` rows
    (any number in the invariant mode, whose launch does not change with them: the same path for a decode step,
    a verify and a prefill), unit stride within a row (also after flattening the leading dims), ``w``
    contiguous; a ``residual`` of the output's shape with unit inner stride and a contiguous norm weight of
    ``[width]``, both in x's dtype and device."""
    if not (_kernel("triton", x, w) and x.dim() >= 2 and x.shape[-1] == width
            and x.stride(-1) == 1 and (x.numel() <= _SKINNY_ROWS * max(width, 1) or invariant_on())
            and w.dim() == 2 and w.is_contiguous()):
        return False
    if residual is not None and not (residual.shape == (*x.shape[:-1], w.shape[0]) and residual.dtype == x.dtype
                                     and residual.device == x.device and residual.stride(-1) == 1):
        return False
    if norm is not None:
        nw = norm[0]
        if not (nw.shape == (width,) and nw.dtype == x.dtype and nw.device == x.device and nw.is_contiguous()):
            return False
    return True


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None, *, residual: Tensor | None = None,
           norm: tuple[Tensor, float, float] | None = None, widen: bool = False) -> Tensor:
    """``F.linear(x, w, bias)`` over the last dim, any leading dims; at most 16 rows without a bias run
    `skinny_linear` (fp32 accumulation, one rounding, as cuBLAS's). ``widen``: the result in fp32, the
    product's bits widened (``.float()`` of it), which the GEMV stores itself: logits.

    ``norm=(weight, eps, offset)``: the product is of ``rms_norm(x, weight, eps, offset=offset)``;
    ``residual`` (the output's shape): added to the product. The kernel folds both (the norm on load, the
    residual into the fp32 accumulator, the sum rounded once); the torch body rounds the product, then the
    sum, as ``F.linear`` then ``+`` do, so the two agree to bf16 rounding. ``x`` may be a `SplitNorm`
    (without ``norm``): its GEMV finishes the norm where it takes it.
    """
    if isinstance(x, SplitNorm):
        if norm is None and bias is None and residual is None and _takes_split(x, w):
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.x.device) if widen else None
            return _own("skinny_linear").skinny_linear(x.scaled, w, rms=x.rms, out=out)
        x = x.tensor()
    if bias is None and _skinny(x, w, w.shape[-1], residual, norm):
        r = None if residual is None else residual.reshape(-1, w.shape[0])  # read only: a copy would do too
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], w.shape[0], dtype=torch.float32, device=x.device) if widen else None
        y = _own("skinny_linear").skinny_linear(rows, w, residual=r, norm=norm, out=out)
        return y.view(*x.shape[:-1], w.shape[0])
    y = row_linear(x if norm is None else rms_norm(x, norm[0], norm[1], offset=norm[2]), w, bias)
    y = y if residual is None else y + residual
    return y.float() if widen else y


def gated_projection(o: Float[Tensor, "T H D"], gate: tuple, w: Float[Tensor, "N K"], project=None):
    """``project(gate applied to o, as [T, H * D], w)``: ``gate`` is ``("silu_norm", z, weight, eps)``, GDN's
    output norm (`gated_rms_norm_silu`), or ``("sigmoid", z)``, gated attention's (`sigmoid_gate`), with
    ``z [T, H, D]`` as the input projection left it; ``project`` defaults to `linear`."""
    project = linear if project is None else project
    o = o.to(gate[1].dtype)
    gated = gated_rms_norm_silu(o, *gate[1:]) if gate[0] == "silu_norm" else sigmoid_gate(o, gate[1])
    return project(gated.reshape(o.shape[0], -1), w)


def gdn_gating(a: Tensor, b: Tensor, neg_decay: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """GDN's log-decay ``g = neg_decay * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)`` (``b.dtype``):
    one launch on CUDA instead of four; ``a``, ``b`` [T, H] may be column slices of one projection."""
    if _kernel("triton", a, b):
        return _own("gdn_gate").gdn_gating(a, b, neg_decay, dt_bias)
    if invariant_on():  # a row's bits must not follow the number of rows (`row_aligned`)
        return row_aligned(_gating_torch, a, b, neg_decay, dt_bias)
    return _gating_torch(a, b, neg_decay, dt_bias)


def _gating_torch(a: Tensor, b: Tensor, neg_decay: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    return neg_decay * F.softplus(a + dt_bias), torch.sigmoid(b)


def project_and_gate(x: Float[Tensor, "T K"], w: Float[Tensor, "N K"], col: int, neg_decay: Float[Tensor, " H"],
                     dt_bias: Float[Tensor, " H"]) -> tuple[Float[Tensor, "T N"], Tensor, Tensor]:
    """GDN's input projection and its gating: ``-> (y = linear(x, w), g, beta)``, ``g`` and ``beta`` from
    the columns ``[col + H, col + 2H)`` (a) and ``[col, col + H)`` (b) of ``y`` as `gdn_gating` makes them.
    Under `gating_epilogue`, at decode sizes on CUDA, one launch (`skinny_linear_gating`), which also
    finishes a `SplitNorm` ``x``."""
    H = neg_decay.shape[0]
    rows = x.scaled if isinstance(x, SplitNorm) else x
    if _GATING_EPILOGUE[-1] and rows.dim() == 2 and _skinny(rows, w, w.shape[-1]) \
            and neg_decay.dtype == torch.float32 and dt_bias.dtype == torch.float32 and neg_decay.is_contiguous() \
            and dt_bias.is_contiguous() and dt_bias.shape == (H,) and 0 <= col <= w.shape[0] - 2 * H:
        return _own("skinny_folds").skinny_linear_gating(rows, w, col, neg_decay, dt_bias,
                                                         rms=None if rows is x else x.rms)
    y = linear(x, w)
    return (y, *gdn_gating(y[..., col + H:col + 2 * H], y[..., col:col + H], neg_decay, dt_bias))


def gate_up_silu(x: Float[Tensor, "T D"], gate_up: Float[Tensor, "I2 D"]) -> Float[Tensor, "T I"]:
    """A SwiGLU MLP's first half: ``silu_and_mul(linear(x, gate_up))`` for ``gate_up = [gate; up]``. Under
    `swiglu_epilogue`, at decode sizes on CUDA, one launch (`skinny_linear_swiglu`), which rounds as the
    GEMV then fnattn's `silu_and_mul` kernel."""
    if _SWIGLU_EPILOGUE[-1] and gate_up.shape[0] % 2 == 0:
        skinny_linear_swiglu = _own("skinny_folds").skinny_linear_swiglu
        if _takes_split(x, gate_up):  # a SplitNorm: its rows scaled by the GEMV before the activation
            return skinny_linear_swiglu(x.scaled, gate_up, rms=x.rms)
        if isinstance(x, Tensor) and x.dim() == 2 and _skinny(x, gate_up, gate_up.shape[-1]):
            return skinny_linear_swiglu(x, gate_up)
    return silu_and_mul(linear(x, gate_up))


def project_add_norm(x: Float[Tensor, "T K"], w: Float[Tensor, "D K"], residual: Float[Tensor, "T D"],
                     weight: Float[Tensor, " D"], eps: float, split: bool = False
                     ) -> tuple[Float[Tensor, "T D"], Float[Tensor, "T D"] | SplitNorm]:
    """An output projection, the residual add and the next block's input norm (Qwen's ``1 + weight``):
    ``-> (residual + linear(x, w), rms_norm_offset(that sum, weight, eps))``.

    The projection is row-parallel under TP: its partial products are all-reduced before the add
    (`fnattn.tp.all_reduce`). Otherwise `linear` then `add_rms_norm_offset_`, which on CUDA writes the sum
    into ``residual`` (pass the step's own tensor). ``split``: the caller hands the norm to a projection
    that takes a `SplitNorm` (`linear`, `project_and_gate`, `gate_up_silu`); under `split_norm`, at decode
    sizes on CUDA without TP, it gets one (`skinny_linear_add_`).
    """
    group = current()
    if split and _SPLIT_NORM[-1] and (group is None or group.size == 1) and x.dim() == 2 \
            and _skinny(x, w, w.shape[-1], residual) and not shares_storage(x, residual) \
            and weight.dtype == x.dtype and weight.shape == (w.shape[0],) and weight.is_contiguous():
        residual, scaled, squares = _own("skinny_folds").skinny_linear_add_(x, w, residual, weight, 1.0)
        return residual, SplitNorm(residual, scaled, squares, weight, eps)
    return add_rms_norm_offset_(all_reduce(linear(x, w)), residual, weight, eps)


def qk_norm_rope(q: Float[Tensor, "T Hq D"], k: Float[Tensor, "T Hkv D"], v: Float[Tensor, "T Hkv Dv"],
                 q_weight: Float[Tensor, " D"], k_weight: Float[Tensor, " D"], eps: float, cos: Float[Tensor, "T Dr"],
                 sin: Float[Tensor, "T Dr"], table: Tensor | None = None
                 ) -> tuple[Float[Tensor, "T Hq D"], Float[Tensor, "T Hkv D"], Float[Tensor, "T Hkv Dv"]]:
    """Attention's inputs from the qkv GEMM's slices ``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]`` (any strides
    but the last): each q / k head RMS-normalized (Qwen's ``1 + weight``), rope on the first
    ``cos.shape[-1]`` dims, all three contiguous: ``-> (q, k, v)``.

    Otherwise `rms_norm_offset` of each, `rope_` (``table``: FlashInfer's) and a copy of ``v`` where it is
    not contiguous. Under `qk_one_launch`, on CUDA, one launch for all of it (`fnattn.kernels.qk_norm_rope`).
    """
    if _QK_ONE_LAUNCH[-1] and _kernel("triton", q, k, v, q_weight, k_weight):
        return _own("qk_norm_rope").qk_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps=eps, offset=1.0)
    q = rms_norm_offset(q, q_weight, eps)  # new contiguous tensors, which rope_ may rotate in place
    k = rms_norm_offset(k, k_weight, eps)
    q, k = rope_(q, k, cos, sin, table)
    return q, k, v.contiguous()  # a no-op at one token
