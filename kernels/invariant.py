"""The invariant mode: a token's result computed in an order that depends only on its own context.

With the switch ``invariant`` on, the paths that honour it compute each token's output with the same
operations on the same shapes whether it shares its step with other tokens or requests, whether the step is
a prefill, a decode or a verify, and whichever bucket it was padded to: split points fixed by key position,
partial results merged in position order, never a shape that follows the step's size. So speculative
greedy decoding emits what plain greedy decoding emits, bit for bit, and a request's logits do not change
when the server is busy.

Every backend declares whether it honours the mode (``fnattn.register(..., invariant=True)``), and a
`ModelAttention` built while the mode is on chooses only those that do; a session (or a replay of a graph)
in the mode over choices made outside it is refused. Honoured by the reference paths of every kind and the
CPU backends that hand a step to them: full attention (through `attention_naive.attention_fixed_order`),
MLA and sparse MLA (`fnattn.kinds.mla.math.mla_fixed_order`, through
`attention_naive.latent_attention_fixed_order`; a sparse token over exactly its selected rows in ascending
position, the indexer scoring on fixed shapes), DeepSeek-V4 (`fnattn.kinds.dsv4.math`
`attend_sinks_fixed_order`); the recurrent kinds (GDN, KDA) run prefill token by token as decode and verify
do (`fnattn.kinds.delta_rule.reference.per_request`), and GDN's per-head gates are computed on rows padded
to whole vector blocks (`row_aligned`). On CUDA: full attention's Triton kernels take their invariant
launch (`paged_decode` / `paged_prefill`, ``invariant=True``: a token alone in its programs, key tiles fixed
by position, no split); GDN / KDA's Triton kernels (one program per request and head, each token's update
in the same order in decode and verify) and, in the mode, their prefill through decode's launches over
every prompt token; dense MLA through its invariant Triton backend (`fnattn.kinds.mla.triton`: the absorbed
query and ``W_UV`` in fixed token tiles, `latent_invariant.latent_attention_invariant` with key tiles fixed by
position; capturable), sparse MLA through the same launches over each token's picks in ascending position
(`fnattn.kinds.sparse_mla.triton`, capturable), DeepSeek-V4 through the same launches over each token's window
and its compressed entries, merged with the sink in that order (`fnattn.kinds.dsv4.triton`, capturable; its
compressors pool and norm in fixed orders in the mode). The models' projections
(`models.norm_rope.row_linear`) take each row as its own product on the CPU (`linear_rows`) and the
fixed-tile GEMM on CUDA (`fnattn.kernels.invariant_linear`), except those `models.fused` takes to the decode
GEMV, whose launch in the mode is fixed by the weight's shape at every row count (`skinny_linear.launch_config`);
RMSNorm's statistics sum each row through the fixed-tile GEMM (`models.norm_rope.row_mean_squares`), and
`models.fused` keeps only fnattn's own kernels, each launch shaped by a row's width (FlashInfer's and fla's
give way to torch bodies). On the CPU torch's
elementwise loops round exp, log, sin and cos differently in their vector body and their scalar tail, so the
fixed-order attention pads its heads to whole vector blocks and the models' activations, gates and rope tables
run on rows padded the same way (`pointwise`).

Importing it imports neither torch nor triton.
"""

from ._switch import declare, switched

_INVARIANT = declare(
    "invariant", False, __name__,
    on="the paths that honour it reduce each token over fixed key tiles merged in position order, in query "
       "blocks of a fixed size: a token's result is the same in every phase, batch and bucket",
    off="each path reduces in the order its shapes suggest (one softmax over a step's new keys merged with "
        "one over the cached keys, matmuls sized by the step)",
    why="off: the fixed order costs a loop over query blocks and key tiles on the CPU; on CUDA the GEMV at one "
        "config per weight shape at every row count, a fixed-tile GEMM for the other projections, grouped products "
        "over the picked experts for MoE, and Triton paths in place of FlashInfer and FlashMLA (which do not "
        "honour it): the Qwen3.5-0.8B graph step took 1.09x / 1.19x / 1.12x / 1.37x as long at batch 1 / 8 / 32 / "
        "128 (H100, 8a4b1e9; a second run 1.08x / 1.08x / 1.09x / 1.34x); with the fused GDN decode and the wider "
        "row and column tiles, 1.12x / 1.09x / 0.96x / 1.13x paired by round (H100, bench_invariance_ab.json at "
        "f72d6d7); with full attention's keys in 64-position splits, 1.03x / 1.00x / 0.87x / 0.99x and 1.04x / "
        "1.05x / 0.87x / 0.99x in two runs (H100, bench_invariance_ab.json at a183f02); DeepSeek-V3.2's 2-layer "
        "step 1.29x / 1.26x / 1.74x at batch 1 / 8 / 32 (H100, 17476a0); "
        "on where bitwise agreement is the point (speculative greedy == plain greedy, tests of batch invariance)")


def invariant(enabled: bool):
    """Within this block the paths that honour the invariant mode (module docstring) run it (or not)."""
    return switched(_INVARIANT, "invariant", enabled)


def invariant_on() -> bool:
    """Whether the invariant mode is in force."""
    return _INVARIANT[-1]


ROW_ALIGN = 64  # elements: two AVX-512 vectors of bf16, the most one iteration of torch's CPU loops takes


def row_aligned(fn, *rows):
    """``fn(*rows)`` with every argument's last dim padded (zeros) to a multiple of `ROW_ALIGN`, the result's cut
    back to the original width.

    Torch's CPU elementwise loops run a vector body over whole blocks of the flattened tensor and a scalar
    tail after it, and the two round transcendental functions (exp, softplus, sigmoid) differently: an
    element's bits depend on where it falls, so on how many tokens share the step. With each row padded to
    whole blocks, every row runs the vector body whatever the number of rows. For per-row ops whose rows are
    narrower than a block (GDN's per-head gates). On CUDA every element runs the same code whatever its place, and
    rows already whole blocks need nothing: both go to ``fn`` as they are (no copy)."""
    import torch.nn.functional as F

    width = rows[0].shape[-1]
    pad = -width % ROW_ALIGN
    if pad == 0 or all(r.is_cuda for r in rows):
        return fn(*rows)
    out = fn(*(F.pad(r, (0, pad)) for r in rows))
    return tuple(o[..., :width] for o in out) if isinstance(out, tuple) else out[..., :width]


def pointwise(fn, *rows):
    """``fn(*rows)``, an elementwise function of rows (an activation, a gate, rope's cos / sin): in the
    invariant mode through `row_aligned`, so a row's exp / log / sin rounds as it would in a step of any size;
    outside it, as is."""
    return row_aligned(fn, *rows) if invariant_on() else fn(*rows)


def linear_rows(x, w, bias=None):
    """``F.linear(x, w, bias)`` with every row its own one-row product: a row's bits whatever the number of rows.

    Torch's CPU GEMM picks its blocking (and so the order it sums over K) from the row count for some shapes:
    on an AVX-512 machine a ``[4, 64] @ [64, 64]`` bf16 product and four ``[1, 64]`` products differ in the last
    bit, and so would a verify's projections and the decode steps'. One row at a time always runs the one-row
    kernel, the order a decode step's product has."""
    import torch
    import torch.nn.functional as F

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= 1:
        return F.linear(x, w, bias)
    y = torch.cat([F.linear(rows[i:i + 1], w, bias) for i in range(rows.shape[0])])
    return y.view(*x.shape[:-1], w.shape[0])
