"""What a decode step must move, for the model bench's rooflines: the weights (a MoE step's routed experts as
many as its tokens pick), the K/V and recurrent rows read and written, and the device's copy bandwidth; and
each layer's profiled time against its own bytes."""

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


def step_bytes(state, batch: int, ctx: int, layers: Sequence[int] | None = None) -> dict[str, int]:
    """K/V and recurrent bytes one decode step moves for ``batch`` requests with ``ctx`` cached tokens (only the
    layers indexed ``layers``, when given)."""
    out = {"kv_read": 0, "kv_written": 0, "state_read": 0, "state_written": 0}
    for spec in state.specs:
        if layers is not None and spec.index not in layers:
            continue
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


def layer_times(model, state, batch: int, ctx: int, touched, bw: float, times_us: list[float], *,
                busy_us: float) -> dict:
    """Each layer's kernel time a step (``times_us``, in layer order) against the bytes it must move: its
    weights (a MoE layer's routed experts as many as ``touched`` counted) and its K/V and recurrent rows, over
    the copy bandwidth ``bw``. ``outside`` is the rest of the step (embedding, final norm, lm_head, the apply)."""
    layers_params = model.params.layers if hasattr(model.params, "layers") else model.params["layers"]
    k, counts = experts_per_token(model.config), iter(touched or ())
    rows, layer_weights = [], 0
    for spec, params, t in zip(model.config.specs, layers_params, times_us, strict=True):
        moe = len(expert_layers(params))
        picked = [next(counts) for _ in range(moe)] if touched is not None else None
        weights = weight_bytes(params, tokens=batch, experts_per_token=k, touched=picked)
        layer_weights += weights
        moved = step_bytes(state, batch, ctx, layers=(spec.index,))
        nbytes = weights + sum(moved.values())
        floor = nbytes / bw * 1e6
        rows.append({"layer": spec.index, "kind": spec.kind, "time_us": t, "bytes": {"weights": weights, **moved},
                     "floor_us": floor, "x_floor": t / floor if floor else None,
                     "achieved_tb_s": nbytes / (t * 1e-6) / 1e12 if t else None})
    in_layers = sum(times_us)
    return {"layers": rows, "layers_us": in_layers, "busy_us": busy_us, "outside_us": busy_us - in_layers,
            "outside_weight_bytes": weight_bytes(model.params, tokens=batch, experts_per_token=k,
                                                 touched=touched) - layer_weights,
            "note": "kernel time inside each layer's profiler range (eager steps: the captured step runs the same "
                    "kernels without the host between them) against its bytes over the copy bandwidth"}


def print_layers(label: str, rec: dict, log=print) -> None:
    """One line per layer kind (layers of one kind sum), then the rest of the step."""
    by_kind: dict[str, list[float]] = {}
    for r in rec["layers"]:
        acc = by_kind.setdefault(r["kind"], [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += r["time_us"]
        acc[2] += r["floor_us"]
    for kind, (n, t, floor) in by_kind.items():
        log(f"{label}: {n} {kind} layers {t:.0f} us, floor {floor:.0f} us ({t / floor:.1f}x)" if floor else
            f"{label}: {n} {kind} layers {t:.0f} us")
    log(f"{label}: outside the layers {rec['outside_us']:.0f} us of {rec['busy_us']:.0f} us busy")
