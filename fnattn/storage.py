"""Storage: the tensors the handles of one `State` lineage share, and which handle is live.

A `State` handle holds host bookkeeping (requests, pages, slots) and a
`Storage`; every successor handle shares it, a copy-mode apply
(``inplace=False``) starts a new one (`Storage.cloned`). Code outside `State`
reaches it through ``state.storage`` and reads it through the names below,
never through the handle's private attributes.

The pools' tensors are fixed for the life of a storage, so anything derived
from them alone (views, the apply's layouts) is built once and kept by the
storage itself (`Storage.derived`, `Storage.views`): no other module stashes
attributes on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from .spec import LayerSpec

_lineages = itertools.count(1)


@dataclass(frozen=True)
class Pool:
    """One storage tensor group shared by layers of identical shape."""

    name: str
    index_space: str  # "token": rows are flat cache slots; "request": rows are recurrent slots
    layers: tuple[int, ...]  # layer indices, in the order of the leading axis
    tensors: Mapping[str, Tensor]  # e.g. {"k": [L, P, S, Hkv, D], "v": [L, P, S, Hkv, Dv]}

    def position(self, layer: int) -> int:
        return self.layers.index(layer)


def _pool_layouts(spec: LayerSpec, *, num_pages: int, page_size: int, num_slots: int):
    """(pool key, index space, {tensor: (shape, dtype)}) for each pool a layer uses, from its kind's
    storage declaration: declarations under one pool label and space form one pool."""
    decls = spec.config.storage(spec.dtype)
    groups: dict[tuple[str, str], list] = {}
    for d in decls:
        groups.setdefault((d.pool, d.space), []).append(d)
    for (label, space), ds in groups.items():
        lead = (num_pages, page_size) if space == "token" else (num_slots,)
        layout = {d.name: (lead + d.shape, d.dtype) for d in ds}
        key = (label, space, tuple((d.name, d.shape, d.dtype) for d in ds))
        yield key, space, layout


def allocate(specs, *, num_pages: int, page_size: int, num_slots: int, fill: float, device) -> tuple[dict, dict]:
    """``-> (pool name -> Pool, layer -> its pools' names)`` of ``specs``, every tensor filled with ``fill``:
    layers whose declarations have the same pool label, index space, names, shapes and dtypes share a pool."""
    groups: dict[tuple, dict] = {}  # storage signature -> pool under construction
    layer_pools: dict[int, list[str]] = {s.index: [] for s in specs}
    for spec in specs:
        for key, space, layout in _pool_layouts(spec, num_pages=num_pages, page_size=page_size, num_slots=num_slots):
            group = groups.get(key)
            if group is None:
                group = groups[key] = {"name": f"{key[0]}{len(groups)}", "space": space, "layout": layout,
                                       "layers": []}
            group["layers"].append(spec.index)
            layer_pools[spec.index].append(group["name"])
    pools = {}
    for g in groups.values():
        tensors = {t: torch.full((len(g["layers"]),) + shape, fill, dtype=dtype, device=device)
                   for t, (shape, dtype) in g["layout"].items()}
        pools[g["name"]] = Pool(g["name"], g["space"], tuple(g["layers"]), MappingProxyType(tensors))
    return pools, {k: tuple(v) for k, v in layer_pools.items()}


class Storage:
    """Tensors shared by the handles of one lineage, and which handle is live.

    ``pools``: pool name -> `Pool`; ``layer_pools``: layer -> the names of the pools it has a slice of;
    ``lineage``: a number no other storage has; ``live_version``: the version of the one live handle;
    ``applied_steps``: the last step ids applied to it (`DoubleApplyError`); ``ring_lent``: (state version,
    session id) the spare ring rows were last handed to (`lend_ring`).
    """

    def __init__(self, pools: dict[str, Pool], layer_pools: dict, live_version: int, applied: tuple,
                 ring_lent=None):
        self.pools = pools
        self.layer_pools = layer_pools  # layer -> tuple of pool names
        self.live_version = live_version
        self.applied_steps = applied
        self.lineage = next(_lineages)
        # (state version, session) the spare ring rows were last handed to: a session over a ring
        # batch is where backends fill them, so only that session's in-place states are valid.
        self.ring_lent = ring_lent
        self._derived: dict = {}
        self._views: dict = {}
        self.views: Mapping[int, Any] = MappingProxyType(self._views)
        """layer -> its `Views`, for the layers `State.views` was asked for (read-only; built there, once)."""

    def cloned(self, version: int) -> Storage:
        """A new storage (a new lineage) holding copies of every tensor, live for handle ``version``."""
        pools = {
            name: replace(p, tensors=MappingProxyType({k: t.clone() for k, t in p.tensors.items()}))
            for name, p in self.pools.items()
        }
        return Storage(pools, self.layer_pools, version, self.applied_steps, self.ring_lent)

    def lend_ring(self, version: int, session: int) -> None:
        """Hand the spare ring rows of the batch of state ``version`` to ``session``: only the in-place
        states of that session are valid from now on."""
        self.ring_lent = (version, session)

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value kept under ``key``, built by ``build()`` on first use.

        For values that depend on the pools alone (fixed for the life of this storage); a copy-mode apply's
        new storage builds its own. Keys start with the name of the module that owns them, e.g.
        ``("apply", "layouts")``.
        """
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = build()
        return found

    def keep_views(self, layer: int, build: Callable[[], Any]) -> Any:
        """``views[layer]``, built by ``build()`` on first use (`State.views` builds them)."""
        found = self._views.get(layer)
        if found is None:
            found = self._views[layer] = build()
        return found

    def tensor_of(self, layer: int, name: str) -> tuple[Pool, Tensor]:
        """``(pool, the layer's slice of its tensor name)``: ``[P, S, *row]`` or ``[N * ring, *row]``."""
        for p in self.layer_pools[layer]:
            pool = self.pools[p]
            if name in pool.tensors:
                return pool, pool.tensors[name][pool.position(layer)]
        raise KeyError(f"Storage.tensor_of: layer {layer} owns no storage named {name!r}")


__all__ = ["Pool", "Storage", "allocate"]
