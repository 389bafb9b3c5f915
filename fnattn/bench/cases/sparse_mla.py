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
from .mla import DEVICE, deepseek_mla, random_inputs


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

    return [record(case, peer, peer, shape, lambda: timed(kernel, graph=graph), flops),
            record(case, "usual (append + absorb + kernel + W_UV)", peer, shape, lambda: timed(usual, graph=graph),
                   flops),
            record(case, "usual + slot translation (append + slots + absorb + kernel + W_UV)", peer, shape,
                   lambda: timed(usual_translating, graph=graph), flops),
            record(case, FNATTN_ROW, peer, shape, through_fnattn, flops)]


def indexer_case(*, batch: int, ctx: int, heads: int = 128, topk: int = 2048, Hi: int = 64, Di: int = 128,
                 page_size: int = 64, graph: bool = True) -> list[dict]:
    from ...kernels import indexer_topk
    from ...kernels.indexer import RADIX_TOPK

    specs, state, b, _ = _setup(batch, ctx, heads, topk, Hi, Di, page_size)
    sparse = SparseQueryMetadata.build(b, topk=topk)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=g).to(torch.bfloat16)  # noqa: E731
    q, w, k = r(batch, Hi, Di), torch.randn(batch, Hi, device=DEVICE, generator=g), r(batch, Di)
    pages = state.views(0).index_k
    run = lambda: indexer_topk(q, w, pages, k, b.block_table, sparse.request_of_token, b.cache_lens,  # noqa: E731
                               b.cu_seqlens, b.positions, scale=Di ** -0.5, topk=topk)
    case = f"indexer B{batch} ctx{ctx} Hi{Hi} Di{Di} topk{topk}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "index_heads": Hi, "index_dim": Di, "topk": topk, "page_size": page_size}
    records = sparse_decode_case(batch=batch, ctx=ctx, heads=heads, topk=topk, page_size=page_size, graph=graph)
    for rec in records:
        rec["case"] = case
    tb = lambda us: {"tb_s": batch * (ctx + 1) * Di * 2 / (us * 1e-6) / 1e12}  # noqa: E731
    records.append(record(case, "fnattn indexer (triton scores + topk)", FNATTN_ROW, shape,
                          lambda: timed(run, graph=graph), tb))
    # the same keys cached as FP8 e4m3 with a scale per token (`IndexerConfig.key_dtype`): half the bytes read
    ix = IndexerConfig(num_heads=Hi, head_dim=Di, topk=topk, key_dtype="fp8_e4m3")
    stored, scales = ix.encode_keys(pages.flatten(0, 1))
    pages8, scales8 = stored.view(pages.shape), scales.view(*pages.shape[:2], 1)
    k8, ks = ix.encode_keys(k)
    run8 = lambda: indexer_topk(q, w, pages8, k8, b.block_table, sparse.request_of_token, b.cache_lens,  # noqa: E731
                                b.cu_seqlens, b.positions, scale=Di ** -0.5, topk=topk, cache_scale=scales8,
                                new_scale=ks)
    tb8 = lambda us: {"tb_s": batch * (ctx + 1) * (Di + 4) / (us * 1e-6) / 1e12}  # noqa: E731
    records.append(record(case, "fnattn indexer (triton scores + topk, fp8 keys)", FNATTN_ROW, shape,
                          lambda: timed(run8, graph=graph), tb8))
    # the same scores, the selection by sgl_kernel's radix select (`radix_select`; top-k 2048 only)
    if topk == RADIX_TOPK:
        radix = lambda: indexer_topk(q, w, pages, k, b.block_table, sparse.request_of_token, b.cache_lens,  # noqa: E731
                                     b.cu_seqlens, b.positions, scale=Di ** -0.5, topk=topk, radix=True)
        records.append(record(case, "fnattn indexer (triton scores + radix select)", FNATTN_ROW, shape,
                              lambda: timed(radix, graph=graph), tb))
    return records
