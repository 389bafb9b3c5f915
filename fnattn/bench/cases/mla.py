"""MLA decode: fnattn's FlashMLA and FlashInfer backends next to raw FlashMLA, in one process.

"flashmla kernel (raw)" is the bar: ``flash_mla_with_kvcache`` alone over caches that already hold
the new token, its query absorbed beforehand. "usual (append + kernel)" adds what a serving engine's
attention layer does around it: write the new latent row, absorb ``W_UK``, the kernel, ``W_UV``. The
fnattn rows are whole pure steps: the backend (absorb, kernel over the cache, the new row beside it,
LSE merge, ``W_UV``) and the one apply of the step's rows. They build the absorbed query in one launch
(`fnattn.kinds.mla.latent.absorb_kernel`) and take the own row's merge and ``W_UV`` in one launch
(`merge_values_kernel`). Those two switches' other sides are timed by ``benchmarks/switch_ab.py mla-decode``.
"""

from __future__ import annotations

import torch

from ... import Batch, LayerSpec, MLAConfig, MLAInputs, ModelAttention
from .. import timed
from ..setup import cached_state
from .full import time_fnattn

DEVICE = "cuda"


def deepseek_mla(heads: int = 128) -> MLAConfig:
    return MLAConfig(num_heads=heads, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def random_inputs(cfg: MLAConfig, T: int, dtype=torch.bfloat16) -> MLAInputs:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=DEVICE, generator=g) * scale).to(dtype)  # noqa: E731
    H, R = cfg.heads, cfg.kv_lora_rank
    return MLAInputs(q_nope=r(T, H, cfg.qk_nope_head_dim), q_pe=r(T, H, cfg.qk_rope_head_dim),
                     latent=r(T, cfg.latent_dim),
                     w_uk=r(H, cfg.qk_nope_head_dim, R, scale=cfg.qk_nope_head_dim ** -0.5),
                     w_uv=r(H, cfg.v_head_dim, R, scale=R ** -0.5))


def raw_flashmla(state, batch, cfg: MLAConfig, inputs: MLAInputs, layers):
    """Closures for the raw kernel and the usual append-then-attend layer, over ``cache_lens + 1`` tokens."""
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    from ...kinds.mla.latent import absorbed_query_torch as absorbed_query
    from ...kinds.mla.latent import values_out

    T, H = inputs.q_nope.shape[:2]
    lens = batch.cache_lens + 1  # the new token is in the cache already, as the usual design has it
    meta, splits = get_mla_metadata(lens, H, 1)
    pools = [state.views(i).latent for i in layers]
    q = absorbed_query(inputs).view(T, 1, H, -1)
    slots = batch.slot_mapping

    def kernel():
        for pool in pools:
            flash_mla_with_kvcache(q, pool.unsqueeze(2), batch.block_table, lens, cfg.kv_lora_rank, meta, splits,
                                   softmax_scale=cfg.scale, causal=False)

    def usual():
        for pool in pools:
            pool.view(-1, pool.shape[-1]).index_copy_(0, slots, inputs.latent)
            qa = absorbed_query(inputs).view(T, 1, H, -1)
            o, _ = flash_mla_with_kvcache(qa, pool.unsqueeze(2), batch.block_table, lens, cfg.kv_lora_rank, meta,
                                          splits, softmax_scale=cfg.scale, causal=False)
            values_out(o.view(T, H, -1), inputs.w_uv)

    return kernel, usual


def decode_case(*, batch: int, ctx: int, heads: int = 128, page_size: int = 64, layers: int = 1,
                graph: bool = True) -> list[dict]:
    cfg = deepseek_mla(heads)
    specs = [LayerSpec(index=i, config=cfg, dtype=torch.bfloat16) for i in range(layers)]
    state = cached_state(specs, batch=batch, ctx=ctx, page_size=page_size)
    b = Batch.decode(state, range(batch))
    inputs = random_inputs(cfg, batch)
    kernel, usual = raw_flashmla(state, b, cfg, inputs, range(layers))
    case = f"mla decode B{batch} ctx{ctx} h{heads} p{page_size} L{layers}" + (" graph" if graph else " eager")
    peer = "flashmla kernel (raw)"
    runs = {peer: lambda: timed(kernel, graph=graph), "usual (append + kernel)": lambda: timed(usual, graph=graph)}
    for name in ("flashmla", "flashinfer"):
        # FlashInfer plans on the host: its step is timed eager (the plan included), never captured.
        g = graph and name == "flashmla"
        ma = ModelAttention(specs, prefer=(name,), device=DEVICE, phases=("decode",))
        runs[f"fnattn {name} (pure)" + ("" if g == graph else " eager")] = (
            lambda ma=ma, g=g: time_fnattn(ma, state, b, specs, inputs, graph=g))
    latent_bytes = layers * batch * (ctx + 1) * cfg.latent_dim * 2
    flops = layers * batch * heads * (ctx + 1) * (cfg.latent_dim + cfg.kv_lora_rank) * 2
    records = []
    for name, measure in runs.items():
        rec = {"case": case, "backend": name, "peer": peer,
               "shape": {"batch": batch, "ctx": ctx, "heads": heads, "page_size": page_size, "layers": layers,
                         "latent": "512+64", "dtype": "bfloat16"}}
        try:
            us = measure()
            rec.update(time_us=us, tb_s=latent_bytes / (us * 1e-6) / 1e12, tflop_s=flops / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
    records.append(floor_record(records, case, layers * weight_bytes(inputs), "fnattn flashmla (pure)",
                                "mla_dense_vs_floor"))
    return records


def weight_bytes(inputs) -> int:
    """Bytes of the layer's ``W_UK`` and ``W_UV``: what an absorbed decode step reads beside the latent cache."""
    return sum(t.numel() * t.element_size() for t in (inputs.w_uk, inputs.w_uv))


def floor_record(records: list[dict], case: str, extra_bytes: int, fnattn_row: str, figure: str) -> dict:
    """The layer's floor: the raw kernel's time (``records[0]``, measured in this run) plus ``extra_bytes`` (the
    weights the layer reads around the kernel) at the copy bandwidth measured now. The fnattn row ``fnattn_row``
    gets ``ratio_to_floor``, also named ``figure`` for scripts."""
    from ..roofline import copy_bandwidth

    raw = records[0]
    rec = {"case": case, "backend": "floor (raw kernel + W_UK / W_UV at the copy bandwidth)", "peer": raw["backend"],
           "shape": raw["shape"], "extra_bytes": extra_bytes}
    if "time_us" not in raw:
        return rec | {"error": "the raw kernel did not run: no floor"}
    bandwidth = copy_bandwidth(torch.device(DEVICE))
    rec.update(time_us=raw["time_us"] + extra_bytes / bandwidth * 1e6, copy_bandwidth_tb_s=bandwidth / 1e12)
    for r in records:
        if r["backend"] == fnattn_row and "time_us" in r:
            r["ratio_to_floor"] = r[figure] = r["time_us"] / rec["time_us"]
    return rec
