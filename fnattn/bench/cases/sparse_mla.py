"""Sparse MLA decode and the DSA indexer: fnattn next to raw ``flash_mla_sparse_fwd``, in one process.

"mla-sparse": a layer reusing a given top-k (GLM-5's shared layer; the indexer is timed apart) through
fnattn's FlashMLA backend (index translation to pool slots, the kernel over the cache, the new row
beside it, LSE merge, ``W_UV``) against the kernel alone on precomputed slots over caches that
already hold the new token, and against the usual layer (the latent written into the pool first, then the
absorption, the kernel and ``W_UV``: the same work as fnattn's but the merge and the slot translation, which
its precomputed slots leave out; a second usual row translates the top-k positions each step). The fnattn row
runs the backend's defaults, named in it (the slots in one pass, the one-launch absorb, the merge kernel and a
batched ``W_UV``); ``benchmarks/switch_ab.py mla-sparse`` times those switches' other sides. "indexer":
the Triton indexer scores plus ``torch.topk`` at the given context, reported next to the sparse attention time
of the same shape.
"""

from __future__ import annotations

import torch

from ... import Batch, IndexerConfig, LayerSpec, ModelAttention, SparseMLAConfig, SparseMLAInputs, SparseQueryMetadata
from ...kinds.mla.latent import absorb_kernel, values_out
from ...kinds.mla.latent import absorbed_query_torch as absorbed_query
from ...kinds.sparse_mla.flashmla import TOPK_BLOCK, merge_values_kernel, one_pass_slots
from .. import timed, timed_session
from ..setup import cached_state
from .mla import DEVICE, deepseek_mla, floor_record, random_inputs, weight_bytes


def _specs(heads, topk, Hi, Di):
    ix = IndexerConfig(num_heads=Hi, head_dim=Di, topk=topk)
    mla = deepseek_mla(heads)
    return [LayerSpec(0, SparseMLAConfig(mla, ix), torch.bfloat16),
            LayerSpec(1, SparseMLAConfig(mla, ix, index_source_layer=0), torch.bfloat16)]


def _setup(batch, ctx, heads, topk, Hi, Di, page_size):
    specs = _specs(heads, topk, Hi, Di)
    state = cached_state(specs, batch=batch, ctx=ctx, page_size=page_size)
    b = Batch.decode(state, range(batch))
    g = torch.Generator(device=DEVICE).manual_seed(2)
    # a random causal top-k per token: the best of random scores over its visible positions
    scores = torch.rand(batch, ctx + 1, device=DEVICE, generator=g)
    idx = scores.topk(min(topk, ctx + 1), dim=-1).indices
    return specs, state, b, idx


FNATTN_ROW = "fnattn flashmla (attention, shared top-k, one-pass slots)"  # the indexer's rows name it their peer


def record(case, name, peer, shape, measure, extra=None):
    rec = {"case": case, "backend": name, "peer": peer, "shape": shape}
    try:
        rec["time_us"] = measure()
        rec.update(extra(rec["time_us"]) if extra else {})
    except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def sparse_decode_setup(*, batch: int, ctx: int, heads: int = 128, topk: int = 2048, page_size: int = 64):
    """``-> (specs, state, batch, inputs, kernel, slots)``: a layer reusing a random causal top-k over ``ctx``
    cached tokens, and raw ``flash_mla_sparse_fwd`` over the same positions as pool slots (``slots``, the kernel's
    int32 lists; the new token's row counted as cached), ready to call."""
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    specs, state, b, idx = _setup(batch, ctx, heads, topk, 64, 128, page_size)
    base = random_inputs(specs[1].config.mla, batch)
    sparse = SparseQueryMetadata.build(b, topk=topk)
    inputs = SparseMLAInputs(q_nope=base.q_nope, q_pe=base.q_pe, latent=base.latent, w_uk=base.w_uk, w_uv=base.w_uv,
                             sparse=sparse, topk_indices=idx)
    pool = state.views(1).latent
    S, req = page_size, sparse.request_of_token[:, None]
    slots = b.block_table.long()[req, idx // S] * S + idx % S
    pad = -slots.shape[1] % TOPK_BLOCK
    raw_idx = torch.nn.functional.pad(slots, (0, pad), value=-1).to(torch.int32).unsqueeze(1).contiguous()
    q = absorbed_query(inputs)
    cfg = specs[1].config.mla
    kernel = lambda: flash_mla_sparse_fwd(q, pool.view(-1, 1, pool.shape[-1]), raw_idx, cfg.scale, 512)  # noqa: E731
    return specs, state, b, inputs, kernel, raw_idx


def usual_sparse_layer(state, b, inputs, kernel_indices, scale):
    """The usual design of the same layer: write the new latent row into the pool, absorb ``W_UK`` into the query,
    the kernel over the top-k slots (the new row among them), ``W_UV`` out. ``kernel_indices``: the kernel's
    int32 slot lists, or a function that builds them inside each step (`usual_sparse_layer_translating`)."""
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    pool = state.views(1).latent
    rows = pool.view(-1, pool.shape[-1])

    def run():
        rows.index_copy_(0, b.slot_mapping, inputs.latent)
        indices = kernel_indices() if callable(kernel_indices) else kernel_indices
        out, _, _ = flash_mla_sparse_fwd(absorbed_query(inputs), pool.view(-1, 1, pool.shape[-1]), indices,
                                         scale, 512)
        return values_out(out, inputs.w_uv)

    return run


def usual_sparse_layer_translating(state, b, inputs, positions, scale):
    """`usual_sparse_layer` that also turns the top-k positions into pool slots each step, as a real layer must
    (the indexer picks positions; the kernel reads slots): fnattn's one-launch translation over the caches as
    they are after the append (the new row counted as cached), so its only difference from fnattn's layer is
    where the own row is read."""
    from ...kernels.sparse_slots import topk_slots

    lens_after = b.cache_lens + 1  # the append puts each request's new row at cache_lens
    request_of_token = inputs.sparse.request_of_token

    def slots():
        found, _, _ = topk_slots(positions, request_of_token, lens_after, b.cu_seqlens, b.block_table,
                                 page_size=b.page_size, pad_to=TOPK_BLOCK)
        return found.unsqueeze(1)

    return usual_sparse_layer(state, b, inputs, slots, scale)


def sparse_decode_case(*, batch: int, ctx: int, heads: int = 128, topk: int = 2048, page_size: int = 64,
                       graph: bool = True) -> list[dict]:
    specs, state, b, inputs, kernel, slots = sparse_decode_setup(batch=batch, ctx=ctx, heads=heads, topk=topk,
                                                                 page_size=page_size)
    usual = usual_sparse_layer(state, b, inputs, slots, specs[1].config.mla.scale)
    usual_translating = usual_sparse_layer_translating(state, b, inputs, inputs.topk_indices,
                                                       specs[1].config.mla.scale)
    ma = ModelAttention(specs, prefer=("flashmla",), device=DEVICE, phases=("decode",))
    peer = "flash_mla_sparse_fwd (raw)"
    case = f"sparse mla decode B{batch} ctx{ctx} h{heads} topk{topk}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "heads": heads, "topk": topk, "page_size": page_size}
    flops = lambda us: {"tflop_s": batch * heads * topk * (576 + 512) * 2 / (us * 1e-6) / 1e12}  # noqa: E731

    def through_fnattn():
        # the switches the row's name states, in force while the step is traced (a graph keeps what it captured)
        with one_pass_slots(True), absorb_kernel(True), merge_values_kernel(False):
            return timed_session(ma, state, b, lambda s: s.forward(1, inputs), graph=graph)

    records = [record(case, peer, peer, shape, lambda: timed(kernel, graph=graph), flops),
               record(case, "usual (append + absorb + kernel + W_UV)", peer, shape, lambda: timed(usual, graph=graph),
                      flops),
               record(case, "usual + slot translation (append + slots + absorb + kernel + W_UV)", peer, shape,
                      lambda: timed(usual_translating, graph=graph), flops),
               record(case, FNATTN_ROW, peer, shape, through_fnattn, flops)]
    # the layer reuses its top-k (no index keys read): the floor is the kernel and W_UK / W_UV
    return records + [floor_record(records, case, weight_bytes(inputs), FNATTN_ROW, "mla_sparse_vs_floor")]


FIELD_ROW = "field pipeline (FP8 keys at the copy bandwidth + sgl_kernel fast_topk_v2)"
FIELD_H200_US = 110.0  # SGLang's H200 profile: DeepGEMM's paged FP8 logits + fast_topk_v2 at 32k, 64 x 128 heads


def indexer_case(*, batch: int, ctx: int, heads: int = 128, topk: int = 2048, Hi: int = 64, Di: int = 128,
                 page_size: int = 64, graph: bool = True) -> list[dict]:
    """The indexer's rows beside the sparse attention of the same shape (`sparse_decode_case`): fnattn's scores
    and selection (bf16 keys, FP8 keys, and the invariant mode's ordered selection), sgl_kernel's
    ``fast_topk_v2`` alone over the same scores, and the field's pipeline as the peer: DeepGEMM's paged FP8
    logits do not load on this torch, so their floor (the FP8 keys and scales at the measured copy bandwidth)
    plus the measured ``fast_topk_v2``. Each indexer row names ``ratio_to_field`` (its time over the peer's)
    and ``ratio_to_field_h200`` (over the 110 us of SGLang's H200 profile at batch 64, 32k)."""
    from ...kernels import indexer_topk
    from ...kernels.indexer import RADIX_TOPK, indexer_scores_paged, radix_reasons
    from ..roofline import copy_bandwidth

    specs, state, b, _ = _setup(batch, ctx, heads, topk, Hi, Di, page_size)
    sparse = SparseQueryMetadata.build(b, topk=topk)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g).to(torch.bfloat16)  # noqa: E731
    q, w, k = r(batch, Hi, Di), torch.randn(batch, Hi, device=DEVICE, generator=g), r(batch, Di)
    pages = state.views(0).index_k
    where = (b.block_table, sparse.request_of_token, b.cache_lens, b.cu_seqlens, b.positions)
    case = f"indexer B{batch} ctx{ctx} Hi{Hi} Di{Di} topk{topk}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "index_heads": Hi, "index_dim": Di, "topk": topk, "page_size": page_size}
    records = sparse_decode_case(batch=batch, ctx=ctx, heads=heads, topk=topk, page_size=page_size, graph=graph)
    for rec in records:
        rec["case"] = case
    # the same keys cached as FP8 e4m3 with a scale per token (`IndexerConfig.key_dtype`): half the bytes read
    ix = IndexerConfig(num_heads=Hi, head_dim=Di, topk=topk, key_dtype="fp8_e4m3")
    stored, scales = ix.encode_keys(pages.flatten(0, 1))
    k8, ks = ix.encode_keys(k)
    fp8 = dict(cache_scale=scales.view(*pages.shape[:2], 1), new_scale=ks)
    keys = {"bf16": (pages, k, {}), "fp8": (stored.view(pages.shape), k8, fp8)}
    key_bytes = {"bf16": batch * (ctx + 1) * Di * 2, "fp8": batch * (ctx + 1) * (Di + 4)}
    run = lambda kind, radix: indexer_topk(q, w, keys[kind][0], keys[kind][1], *where, scale=Di ** -0.5,  # noqa: E731
                                           topk=topk, radix=radix, **keys[kind][2])
    # the peer: the FP8 keys' bytes at the copy bandwidth, plus fast_topk_v2 timed over the same scores
    scores = indexer_scores_paged(q, w, keys["fp8"][0], k8, *where, scale=Di ** -0.5, **fp8)
    floor_us = key_bytes["fp8"] / copy_bandwidth(scores.device) * 1e6
    peer = {"case": case, "backend": FIELD_ROW, "peer": FIELD_ROW, "shape": shape, "logits_floor_us": floor_us}
    if topk == RADIX_TOPK and not radix_reasons(scores, topk):
        lengths = (b.positions + 1).clamp(max=scores.shape[1]).to(torch.int32)
        picked = torch.full((batch, topk), -1, dtype=torch.int32, device=scores.device)
        select = lambda: torch.ops.sgl_kernel.fast_topk(scores, picked, lengths, None)  # noqa: E731
        records.append(record(case, "sgl_kernel fast_topk_v2 alone (over the FP8 keys' scores)", FIELD_ROW, shape,
                              lambda: timed(select, graph=graph)))
        if "time_us" in records[-1]:
            peer["time_us"] = floor_us + records[-1]["time_us"]
    records.append(peer)

    def versus(kind, named):
        def extra(us):
            out = {"tb_s": key_bytes[kind] / (us * 1e-6) / 1e12, "ratio_to_field_h200": us / FIELD_H200_US}
            if named:  # the issue's figure: the field's pipeline reads FP8 keys, at DeepSeek-V3.2's serving shape
                out["indexer_vs_deepgemm"] = us / FIELD_H200_US
            return out | ({"ratio_to_field": us / peer["time_us"]} if "time_us" in peer else {})
        return extra

    for kind in ("bf16", "fp8"):
        for radix, how in ((True, "radix select where it serves, sorted by position (the default mode)"),
                           (False, "ordered top-k (the invariant mode)")):
            named = kind == "fp8" and radix and (batch, ctx) == (64, 32768)
            records.append(record(case, f"fnattn indexer ({kind} keys, {how})", FIELD_ROW, shape,
                                  lambda: timed(lambda: run(kind, radix), graph=graph), versus(kind, named)))
    return records
