"""DeepSeek-V4's CSA indexer at decode (64 index heads of 128, an entry every 4 tokens, top-k 512 and 1024):
fnattn's paged Triton scores and sgl_kernel's DeepSeek-V4 selection, against the torch form over gathered keys
and against the field's floor (the entries' keys at the copy bandwidth plus the selection kernel alone)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .. import timed
from .mla import DEVICE

FLOOR_ROW = "floor (index keys at the copy bandwidth + sgl_kernel deepseek_v4_topk_transform_512)"


def csa_indexer_case(*, batch: int, ctx: int, topk: int, Hi: int = 64, Di: int = 128, m: int = 4,
                     page_size: int = 64, graph: bool = True) -> list[dict]:
    from ...kernels.indexer import sgl_kernel_op
    from ...kinds.dsv4.batched import V4_TOPK, gathered_scores, ordered, paged_scores, token_requests, top_k
    from ..roofline import copy_bandwidth
    from .sparse_mla import record

    g = torch.Generator(device=DEVICE).manual_seed(5)
    M = -(-(ctx + 1) // page_size)
    pool = torch.randn(batch * M + 1, page_size, Di, device=DEVICE, generator=g).to(torch.bfloat16)
    table = (torch.randperm(batch * M, device=DEVICE, generator=g) + 1).view(batch, M).to(torch.int32)
    c0 = torch.full((batch,), ctx, device=DEVICE)
    step = SimpleNamespace(cache_lens=c0, block_table=table, page_size=page_size, num_requests=batch,
                           cu_seqlens=torch.arange(batch + 1, device=DEVICE), positions=c0.clone())
    rows = torch.randn(batch, Di, device=DEVICE, generator=g).to(torch.bfloat16)
    q = torch.randn(batch, Hi, Di, device=DEVICE, generator=g).to(torch.bfloat16)
    w = torch.randn(batch, Hi, device=DEVICE, generator=g)
    args = (SimpleNamespace(index_k=pool), step, token_requests(step), step.positions, q, w, rows,
            SimpleNamespace(head_dim=Di, topk=topk), m)
    case = f"dsv4 csa indexer B{batch} ctx{ctx} Hi{Hi} Di{Di} topk{topk}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "entries": ctx // m, "index_heads": Hi, "index_dim": Di, "topk": topk}
    key_bytes = batch * (ctx // m + 1) * Di * 2
    floor = {"case": case, "backend": FLOOR_ROW, "peer": FLOOR_ROW, "shape": shape,
             "keys_us": key_bytes / copy_bandwidth(torch.device(DEVICE)) * 1e6}
    records = []
    has_op = sgl_kernel_op(V4_TOPK)
    if topk <= 1024 and has_op:
        scores = paged_scores(*args)
        lengths = ((step.positions + 1) // m).to(torch.int32)
        out = torch.empty(batch, topk, dtype=torch.int32, device=DEVICE)
        raw = torch.empty_like(out)
        select = lambda: getattr(torch.ops.sgl_kernel, V4_TOPK)(  # noqa: E731
            scores, lengths, table, out, page_size // m, raw)
        records.append(record(case, "sgl_kernel deepseek_v4_topk_transform_512 alone", FLOOR_ROW, shape,
                              lambda: timed(select, graph=graph)))
        if "time_us" in records[-1]:
            floor["time_us"] = floor["keys_us"] + records[-1]["time_us"]
    elif not has_op:
        floor["why"] = f"this sgl_kernel build has no {V4_TOPK}: the floor is the keys' bytes alone"
    records.append(floor)

    def versus(us):
        return {"tb_s": key_bytes / (us * 1e-6) / 1e12} | (
            {"ratio_to_floor": us / floor["time_us"]} if "time_us" in floor else {})

    ours = ("fnattn csa indexer (paged Triton scores + sgl_kernel selection, sorted)" if has_op and topk <= 1024
            else "fnattn csa indexer (paged Triton scores + ordered top-k)")
    records.append(record(case, ours, FLOOR_ROW, shape, lambda: timed(lambda: top_k(*args), graph=graph), versus))
    records.append(record(case, "torch form (gathered keys + ordered top-k)", FLOOR_ROW, shape,
                          lambda: timed(lambda: ordered(gathered_scores(*args), topk), graph=graph), versus))
    return records
