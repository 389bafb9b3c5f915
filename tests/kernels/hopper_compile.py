"""Compile decode-step kernels for sm_90 on a machine without a GPU (Triton's own ptxas): what the
interpreter cannot see, such as a loop-carried value whose shape changes, fails here as it would on the
H200. Run as a script, without TRITON_INTERPRET (the interpreter replaces the kernels' jit objects):
``python tests/kernels/hopper_compile.py`` prints one ``ok <case>`` or ``FAILED <case>: <error>`` line each."""

import inspect
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's fnattn, not another install

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_for_hopper(jit_fn, constexprs: dict, pointers: dict, floats=()):
    """``jit_fn`` with ``constexprs`` bound, ``pointers`` as {name: "*bf16", ...}, ``floats`` fp32 scalars,
    every other argument an int32 scalar."""
    params = list(inspect.signature(jit_fn.fn).parameters)
    missing = [p.name for p in jit_fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"constexprs: expected values for {missing}")
    sig = {p: "constexpr" if p in constexprs else pointers.get(p) or ("fp32" if p in floats else "i32")
           for p in params}
    src = ASTSource(jit_fn, sig, constexprs={(params.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


def skinny_cases():
    from fnattn.kernels.skinny_linear import _skinny_gemv_kernel

    ptr = {p: "*bf16" for p in ("X", "W", "Y", "R", "NW", "GB", "U", "UW")}
    ptr.update(P="*fp32", C="*i32", GG="*fp32", GND="*fp32", GDTB="*fp32", SQ_IN="*fp32", SQ_OUT="*fp32")
    widened = {**ptr, "Y": "*fp32"}
    base = dict(ACT_SILU_MUL=False, HAS_RESIDUAL=False, NORM=False, NORM_OFFSET=False, USE_DOT=True, FP32_DOT=False,
                SPLIT=False, ONE_LAUNCH=False, PDL=True, PREFETCH=False, LINES=2, GATING=False, LIBDEVICE=True,
                SWIGLU=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, EARLY=1, WIDEN=False, RMS_SCALE=False, BLOCK_P=1,
                ADD_SQUARES=False, PIECES=False, ROWS_FIRST=False)
    variants = {
        "gemv": {},
        "gemv swiglu": dict(SWIGLU=True),
        "gemv swiglu split one launch early 4": dict(SWIGLU=True, SPLIT=True, ONE_LAUNCH=True, EARLY=4),
        "gemv gating early 2": dict(GATING=True, EARLY=2),
        "gemv norm + residual early 4": dict(NORM=True, NORM_OFFSET=True, HAS_RESIDUAL=True, EARLY=4),
        "gemv silu_mul split early 2": dict(ACT_SILU_MUL=True, SPLIT=True, ONE_LAUNCH=True, EARLY=2),
        "gemv split one launch, prefetch, early 4": dict(SPLIT=True, ONE_LAUNCH=True, PREFETCH=True, EARLY=4),
        "gemv fma early 2": dict(USE_DOT=False, BLOCK_M=1, EARLY=2),
        "gemv widened to fp32": dict(WIDEN=True),
        "gemv add + squares, split one launch": dict(HAS_RESIDUAL=True, ADD_SQUARES=True, SPLIT=True, ONE_LAUNCH=True),
        "gemv add + squares": dict(HAS_RESIDUAL=True, ADD_SQUARES=True),
        "gemv rms row scale, swiglu": dict(RMS_SCALE=True, BLOCK_P=32, SWIGLU=True),
        "gemv rms row scale, gating": dict(RMS_SCALE=True, BLOCK_P=32, GATING=True),
        "gemv rms row scale, widened": dict(RMS_SCALE=True, BLOCK_P=32, WIDEN=True),
        "gemv rms row scale, split one launch": dict(RMS_SCALE=True, BLOCK_P=32, SPLIT=True, ONE_LAUNCH=True),
        "gemv K pieces in one program (invariant mode), add + squares": dict(PIECES=True, HAS_RESIDUAL=True,
                                                                              ADD_SQUARES=True),
        "gemv K pieces in one program (invariant mode), swiglu": dict(PIECES=True, SWIGLU=True),
        "gemv row tiles first (invariant mode), split one launch": dict(ROWS_FIRST=True, SPLIT=True, ONE_LAUNCH=True),
    }
    for name, change in variants.items():
        yield name, lambda c={**base, **change}: compile_for_hopper(
            _skinny_gemv_kernel, c, widened if c["WIDEN"] else ptr,
            floats=("eps", "offset", "u_offset"))


def gdn_decode_cases():
    from fnattn.kernels.gdn_decode_fused import _fused_decode_kernel

    ptr = {p: "*bf16" for p in ("x_ptr", "w_ptr", "bias_ptr", "cpool_ptr", "beta_ptr", "o_ptr", "win_ptr")}
    ptr.update(g_ptr="*fp32", pool_ptr="*fp32", out_ptr="*fp32", slots_ptr="*i64", cu_ptr="*i32",
               out_rows_ptr="*i64")
    for bv in (16, 64):
        for first in (False, True):
            c = dict(HK=16, HV=16, K=128, V=128, W=4, BK=128, BV=bv, HAS_BIAS=False, SILU=True, IS_KDA=False,
                     L2NORM=True, OUT_ROWS=True, PDL=True, STATE_FIRST=first)
            yield (f"fused gdn decode BV{bv}{' state first' if first else ''}",
                   lambda c=c: compile_for_hopper(_fused_decode_kernel, c, ptr, floats=("scale",)))


def paged_decode_cases():
    from fnattn.kernels.paged_attention import _merge_ordered_splits_kernel, _paged_attn_kernel

    ptr = {p: "*bf16" for p in ("Q", "K_NEW", "V_NEW", "K_CACHE", "V_CACHE", "OUT")}
    ptr.update(BLOCK_TABLE="*i32", CACHE_LENS="*i32", CU_SEQLENS="*i32", SINKS="*fp32", LSE="*fp32",
               O_PART="*fp32", LSE_PART="*fp32", L_PART="*fp32")
    base = dict(HKV=2, G=4, G_PAD=4, D=256, D_PAD=256, DV=256, DV_PAD=256, PAGE=16, BLOCK_M=16, BLOCK_N=32,
                DECODE=True, HAS_NEW=True, HAS_SINK=False, SOFTCAP=False, WINDOW=False, SPLIT=True, IEEE=False,
                PDL=True, INVARIANT=False, SPLIT_KEYS=64)
    variants = {
        "paged decode d256 split": {},
        "paged decode d128 split, sinks": dict(D=128, D_PAD=128, DV=128, DV_PAD=128, BLOCK_N=64, HAS_SINK=True),
        "paged attention invariant d256, window": dict(G_PAD=16, DECODE=False, SPLIT=False, WINDOW=True,
                                                        INVARIANT=True),
        "paged attention invariant d128, sinks, softcap": dict(D=128, D_PAD=128, DV=128, DV_PAD=128, BLOCK_N=64,
                                                               G_PAD=16, DECODE=False, SPLIT=False, HAS_SINK=True,
                                                               SOFTCAP=True, INVARIANT=True),
        "paged attention invariant d256, a split a program": dict(G_PAD=16, DECODE=False, INVARIANT=True),
    }
    for name, change in variants.items():
        yield name, lambda c={**base, **change}: compile_for_hopper(_paged_attn_kernel, c, ptr,
                                                                     floats=("sm_scale", "softcap"))
    yield "paged attention invariant, splits merged in order, sinks", lambda: compile_for_hopper(
        _merge_ordered_splits_kernel, dict(DV=256, DV_PAD=256, BLOCK_H=16, HAS_SINK=True), ptr)


def conv_cases():
    from fnattn.kernels.gdn_conv import _conv_chunks_kernel, _conv_first_chunks_kernel, _conv_kernel

    ptr = {p: "*bf16" for p in ("x_ptr", "w_ptr", "bias_ptr", "pool_ptr", "y_ptr", "out_ptr")}
    ptr.update(slots_ptr="*i64", cu_ptr="*i32")
    base = dict(W=4, BT=32, BC=128, HAS_BIAS=False, SILU=True, PER_POS=False, INTERIOR=False, SPLIT=False)
    for name, change in {"gdn conv": {}, "gdn conv, interior tiles": dict(INTERIOR=True),
                         "gdn conv, per-position windows": dict(PER_POS=True),
                         "gdn conv, q / k / v apart": dict(INTERIOR=True, SPLIT=True)}.items():
        yield name, lambda c={**base, **change}: compile_for_hopper(_conv_kernel, c, ptr)
    chunk_ptr = {**ptr, "seq_ptr": "*i32", "idx_ptr": "*i32"}
    base = dict(W=4, BT=64, BC=128, HAS_BIAS=True, SILU=True, SPLIT=False, EVEN_C=False)
    for name, change in {"gdn conv, chunk tiles": {},
                         "gdn conv, chunk tiles, q / k / v apart, tokens first": dict(SPLIT=True, CHANNELS_FIRST=False),
                         "gdn conv, chunk tiles, even, q / k / v apart": dict(SPLIT=True, EVEN_C=True)}.items():
        c = {**base, "CHANNELS_FIRST": True, **change}
        yield name, lambda c=c: compile_for_hopper(_conv_chunks_kernel, c, chunk_ptr)
    for name, change in {"gdn conv, first chunks": {}, "gdn conv, first chunks, even, q / k / v apart":
                         dict(SPLIT=True, EVEN_C=True)}.items():
        yield name, lambda c={**base, **change}: compile_for_hopper(_conv_first_chunks_kernel, c, ptr)


def indexer_cases():
    from fnattn.kernels.indexer import _scores_kernel, _sort_rows_kernel

    ptr = {p: "*bf16" for p in ("q_ptr", "kc_ptr", "kn_ptr")}
    ptr.update(w_ptr="*fp32", bt_ptr="*i32", req_ptr="*i64", cl_ptr="*i32", cu_ptr="*i32", pos_ptr="*i64",
               out_ptr="*fp32")
    # V3.2's 64 heads of 128
    base = dict(BLOCK_H=64, BLOCK_D=128, BLOCK_N=128, SPLIT=512, FP8=False, KEYS_MAJOR=True, PRECISION="tf32")
    fp8 = {**ptr, "kc_ptr": "*fp8e4nv", "kn_ptr": "*fp8e4nv", "cs_ptr": "*fp32", "ns_ptr": "*fp32"}
    for name, (change, pointers) in {
            "indexer scores": ({}, ptr), "indexer scores, heads-major dot": (dict(KEYS_MAJOR=False), ptr),
            "indexer scores, 256 a dot": (dict(BLOCK_N=256, SPLIT=2048), ptr),
            "indexer scores, fp8 keys": (dict(FP8=True), fp8),
            "indexer scores, fp32 queries (an IEEE dot)": (dict(PRECISION="ieee", BLOCK_H=16, BLOCK_D=32, BLOCK_N=16,
                                                                SPLIT=16),
                                                           {**ptr, "q_ptr": "*fp32", "kc_ptr": "*fp32",
                                                            "kn_ptr": "*fp32"})}.items():
        yield name, lambda c={**base, **change}, p=pointers: compile_for_hopper(_scores_kernel, c, p,
                                                                               floats=("scale",))
    for block in (512, 4096):
        yield f"sort positions, {block} a row", lambda b=block: compile_for_hopper(
            _sort_rows_kernel, dict(BLOCK=b), {"x_ptr": "*i32", "out_ptr": "*i64"})


def absorb_cases():
    from fnattn.kernels.latent_absorb import _absorb_query_kernel

    ptr = {p: "*bf16" for p in ("QN", "QP", "W", "OUT")}
    base = dict(BLOCK_T=64, BLOCK_K=128, BLOCK_P=64, K_STEPS=1, NUM_STAGES=2)
    for name, tiles in {"absorbed query, 128 columns a program": dict(BLOCK_R=128),
                        "absorbed query, 64 columns a program": dict(BLOCK_R=64),
                        "absorbed query, 2 pipelined steps of 64 rows": dict(BLOCK_R=128, BLOCK_K=64, K_STEPS=2),
                        "absorbed query, 4 steps of 32 rows, 3 stages, 16 tokens": dict(
                            BLOCK_R=64, BLOCK_K=32, K_STEPS=4, NUM_STAGES=3, BLOCK_T=16)}.items():
        yield name, lambda c={**base, **tiles}, p=ptr: compile_for_hopper(_absorb_query_kernel, c, p)
    from fnattn.kernels.latent_absorb import _merge_own_values_kernel

    ptr = {p: "*bf16" for p in ("O_C", "Q", "NEW", "W", "OUT")}
    ptr.update(L_C="*fp32", LSE_OUT="*fp32", CACHE_LENS="*i32", ALLOWED="*i8")
    base = dict(BLOCK_T=64, BLOCK_Q=64, BLOCK_R=64, BLOCK_V=128, HAS_LENS=True, HAS_ALLOWED=False)
    for name, change in {"own-row merge + W_UV, dense": {},
                         "own-row merge + W_UV, sparse (picked mask), 16 tokens a program":
                             dict(HAS_LENS=False, HAS_ALLOWED=True, BLOCK_T=16),
                         "own-row merge + W_UV, 32 columns of Dv a program, 128 latent a step":
                             dict(BLOCK_V=32, BLOCK_R=128, BLOCK_T=32)}.items():
        yield name, lambda c={**base, **change}, p=ptr: compile_for_hopper(_merge_own_values_kernel, c, p,
                                                                           floats=("sm_scale", "lse_scale"))


def merge_new_token_cases():
    from fnattn.kernels.lse_merge import _merge_new_token_kernel

    ptr = {p: "*bf16" for p in ("O_C", "Q", "K", "V", "OUT")}
    ptr.update(L_C="*fp32", LSE_OUT="*fp32", CACHE_LENS="*i32", ALLOWED="*i8")
    base = dict(G=1, D=576, D_PAD=1024, DV=512, DV_PAD=512, SOFTCAP=False, HAS_LENS=True, HAS_ALLOWED=False)
    for name, change in {"own-token merge, MLA latent": {},
                         "own-token merge, GQA with softcap and the picked mask": dict(
                             G=4, D=128, D_PAD=128, DV=128, DV_PAD=128, SOFTCAP=True, HAS_ALLOWED=True)}.items():
        yield name, lambda c={**base, **change}, p=ptr: compile_for_hopper(
            _merge_new_token_kernel, c, p, floats=("sm_scale", "softcap", "lse_scale"))


def invariant_linear_cases():
    from fnattn.kernels.invariant_linear import CHUNK_K, TILE, _add_chunks_kernel, _invariant_linear_kernel

    tile = dict(BLOCK_M=TILE["block_m"], BLOCK_N=TILE["block_n"], BLOCK_K=TILE["block_k"], CHUNK=CHUNK_K)
    for name, dtype, change in (("invariant GEMM bf16", "bf16", dict(HAS_BIAS=False, PRECISION="tf32")),
                                ("invariant GEMM bf16 with bias", "bf16", dict(HAS_BIAS=True, PRECISION="tf32")),
                                ("invariant GEMM fp32 (ieee dot)", "fp32", dict(HAS_BIAS=True, PRECISION="ieee"))):
        for split in (False, True):
            ptr = {p: f"*{dtype}" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
            if split:
                ptr["y_ptr"] = "*fp32"  # the chunks' sums
            yield f"{name}{', K chunks split' if split else ''}", lambda c={**tile, **change, "SPLIT": split}, \
                p=ptr: compile_for_hopper(_invariant_linear_kernel, c, p)
    yield "invariant GEMM, chunks added in order", lambda: compile_for_hopper(
        _add_chunks_kernel, dict(HAS_BIAS=True, BLOCK=1024), {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"})


def latent_invariant_cases():
    from fnattn.kernels.latent_invariant import _latent_attention_kernel, _merge_splits_kernel

    ptr = {p: "*bf16" for p in ("Q", "CACHE", "NEW")}
    ptr.update(BLOCK_TABLE="*i32", CACHE_LENS="*i32", POSITIONS="*i64", REQUESTS="*i64", INDICES="*i64",
               OUT="*fp32", LSE="*fp32", M_PART="*fp32", L_PART="*fp32", ACC_PART="*fp32")
    base = dict(BLOCK_H=16, BLOCK_N=32, BLOCK_D=64, BLOCK_R=512, SPLIT_TILES=32)
    for name, change in {"invariant latent attention, MLA (576 / 512)": dict(D_STEPS=9, SPARSE=False),
                         "invariant latent attention, sparse MLA picks": dict(D_STEPS=9, SPARSE=True),
                         "invariant latent attention, DeepSeek-V4 K=V 512": dict(D_STEPS=8, SPARSE=True)}.items():
        for partial in (False, True):
            yield f"{name}{', a split a program' if partial else ''}", \
                lambda c={**base, **change, "PARTIAL": partial}: compile_for_hopper(_latent_attention_kernel, c, ptr,
                                                                                     floats=("scale",))
    yield "invariant latent attention, splits merged in order", lambda: compile_for_hopper(
        _merge_splits_kernel, dict(BLOCK_H=16, BLOCK_N=32, BLOCK_R=512, SPARSE=False, SPLIT_TILES=32), ptr)


def main() -> int:
    failed = 0
    for name, build in [*skinny_cases(), *gdn_decode_cases(), *paged_decode_cases(), *conv_cases(),
                        *indexer_cases(), *absorb_cases(), *merge_new_token_cases(), *invariant_linear_cases(),
                        *latent_invariant_cases()]:
        try:
            build()
            print(f"ok {name}")
        except Exception as e:  # noqa: BLE001 - every case is reported
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-600:]}".replace("\n", " "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
