"""What a decode step must move, for the model bench's rooflines: the weights (a MoE step's routed experts as
many as its tokens pick), the K/V and recurrent rows read and written, and the device's copy bandwidth."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch


def _tensors(x, experts: list | None = None):
    """The tensors under ``x`` (tuples, lists, dicts, dataclass fields). With ``experts`` (a list), a dataclass
    field named ``experts`` (a tuple, one entry per routed expert, or a `StackedExperts`) is not walked: each
    expert's tensors go there, one list per MoE layer."""
    from ..models.common import StackedExperts

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v, experts)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, experts)
    elif hasattr(x, "__dataclass_fields__"):
        for name in x.__dataclass_fields__:
            value = getattr(x, name)
            if experts is not None and name == "experts" and isinstance(value, (tuple, StackedExperts)) and len(value):
                experts.append([list(_tensors(expert)) for expert in value])
            else:
                yield from _tensors(value, experts)


def expert_layers(params) -> list[list[list[torch.Tensor]]]:
    """Each MoE layer's routed experts under ``params``, in layer order: one list of tensors per expert."""
    experts: list = []
    for _ in _tensors(params, experts):
        pass
    return experts


def weight_bytes(params, *, tokens: int | None = None, experts_per_token: int | None = None,
                 touched: Sequence[int] | None = None) -> int:
    """Bytes of every distinct tensor storage the params hold (views and tied weights counted once).

    A MoE model's decode step reads only the routed experts its tokens pick: with ``touched``, each MoE layer's
    count of distinct picked experts in layer order (`models.common.counting_routed_experts` over a real step);
    else, with ``tokens`` and ``experts_per_token``, as many as ``tokens`` tokens touch on average when each
    picks ``experts_per_token`` of the ``E`` experts uniformly, ``E * (1 - (1 - k / E) ** tokens)``.
    """
    experts: list[list[list[torch.Tensor]]] = []  # per MoE layer, each routed expert's tensors
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(params, experts)}
    total = sum(storages.values())
    if touched is not None and len(touched) != len(experts):
        raise ValueError(f"touched: expected a count for each of the {len(experts)} MoE layers, got {len(touched)}")
    for i, layer in enumerate(experts):
        # by the tensors' own sizes: experts may be views of one stacked storage
        per_expert = sum(t.numel() * t.element_size() for expert in layer for t in expert) / len(layer)
        E = len(layer)
        if touched is not None:
            count = min(touched[i], E)
        elif tokens is None or experts_per_token is None:
            count = E
        else:
            count = E * (1 - (1 - min(experts_per_token, E) / E) ** tokens)
        total += round(count * per_expert)
    return total


def experts_per_token(config) -> int | None:
    """Routed experts each token picks, from a family's adapted config (None: not a MoE model)."""
    for owner, name in ((config, "num_experts_per_tok"), (config, "top_k"),
                        (getattr(config, "moe", None), "num_experts_per_tok")):
        value = getattr(owner, name, None) if owner is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def step_bytes(state, batch: int, ctx: int) -> dict[str, int]:
    """K/V and recurrent bytes one decode step moves for ``batch`` requests with ``ctx`` cached tokens."""
    out = {"kv_read": 0, "kv_written": 0, "state_read": 0, "state_written": 0}
    for spec in state.specs:
        views = state.views(spec.index)
        for name, space in state.storage_spaces[spec.index].items():
            t = views[name]
            row = t.shape[2:] if space == "token" else t.shape[1:]
            nbytes = math.prod(row) * t.element_size()
            if space == "token":
                out["kv_read"] += batch * ctx * nbytes
                out["kv_written"] += batch * nbytes
            else:
                out["state_read"] += batch * nbytes
                out["state_written"] += batch * nbytes
    return out


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s the device moves copying one buffer into another (read + write), measured now."""
    if device.type == "cuda":
        from . import copy_bandwidth_tbs

        return copy_bandwidth_tbs() * 1e12
    n = 256 << 20
    src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n / min(times)
