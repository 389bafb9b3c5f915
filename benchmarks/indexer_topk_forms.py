"""The indexer's selection over the shipped scores, in the forms torch and sgl_kernel offer, at DeepSeek-V3.2's
decode shape (64 indexer heads of 128, top-k 2048): which part of ``torch.topk``'s time is its final sort, and
whether another form keeps the same set faster.

    python benchmarks/indexer_topk_forms.py [--batch 64] [--ctx 32768] [--out indexer_topk_forms.json]

Every form's set is compared with ``torch.topk``'s (``same_set``); each is timed graph-replayed, the cache
flushed before each call.
"""

import argparse
import json

import torch
from fnattn.kernels.indexer import _radix_select, indexer_scores_paged, radix_reasons
from indexer_sweep import inputs  # the sweep's decode inputs: this file's folder is on the path

from fnattn.bench import environment, timed


def best_first_of_unsorted(scores, k):
    vals, idx = scores.topk(k, dim=-1, sorted=False)
    order = vals.sort(dim=-1, descending=True).indices
    return idx.gather(-1, order)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    q, w, cache_k, new_k, table, every, cache_lens, cu, positions = inputs(a.batch, a.ctx, heads=64, dim=128, page=64)
    scores = indexer_scores_paged(q, w, cache_k, new_k, table, every, cache_lens, cu, positions, scale=128 ** -0.5)
    k = a.topk
    forms = {
        "torch.topk (sorted, shipped)": lambda: scores.topk(k, dim=-1).indices,
        "torch.topk sorted=False": lambda: scores.topk(k, dim=-1, sorted=False).indices,
        "torch.topk sorted=False, then its k sorted": lambda: best_first_of_unsorted(scores, k),
        "torch.sort, the first k": lambda: scores.sort(dim=-1, descending=True).indices[:, :k],
    }
    if not radix_reasons(scores, k):
        forms["radix select (sgl_kernel), by position"] = lambda: _radix_select(scores, positions, k)
    want = torch.sort(forms["torch.topk (sorted, shipped)"](), dim=-1).values
    records = []
    for name, fn in forms.items():
        got = torch.sort(fn().long(), dim=-1).values
        us = timed(fn)
        rec = {"form": name, "batch": a.batch, "ctx": a.ctx, "topk": k, "time_us": us,
               "same_set": bool(torch.equal(got, want))}
        records.append(rec)
        print(f"{name:48s} {us:8.2f} us  same set {rec['same_set']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": f"python benchmarks/indexer_topk_forms.py --batch {a.batch} --ctx {a.ctx} "
                                  f"--topk {a.topk}", "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
