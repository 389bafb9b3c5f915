"""fnattn: attention for LLM inference as pure functions.

Every backend is ``backend(spec, views, inputs) -> (outputs, writes)``; a
driver applies the writes of a step once, with `State.apply`.

The public names load on first use (``fa.State``, ``from fnattn import State``): importing the
package alone imports no torch, so ``fnattn --help`` answers at once.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# Public name -> the module (relative to this package) that defines it.
_EXPORTS = {
    **dict.fromkeys(["PHASES", "Batch"], "batch"),
    "CursorAdvance": "cursor",
    **dict.fromkeys(["Output", "StepDeltas", "Writes", "writes"], "deltas"),
    **dict.fromkeys(["DoubleApplyError", "LeaseError", "NoBackendError", "OutsideSessionError",
                     "PoolExhaustedError", "PurityError", "SessionClosedError", "StaleDeltasError",
                     "StaleStateError"], "errors"),
    **dict.fromkeys(["StepMeta", "StorageDecl", "inputs", "kind", "kind_info", "known_kinds", "per_request",
                     "per_token", "register_kind"], "declare"),
    **dict.fromkeys(["GDNConfig", "KDAConfig", "RecurrentInputs", "RecurrentOutput"], "kinds.delta_rule"),
    "DSV4Config": "kinds.dsv4",
    **dict.fromkeys(["FullAttentionConfig", "FullAttentionInputs"], "kinds.full"),
    **dict.fromkeys(["MLAConfig", "MLAInputs"], "kinds.mla"),
    **dict.fromkeys(["IndexerConfig", "SparseAttentionOutput", "SparseMLAConfig", "SparseMLAInputs",
                     "SparseQueryMetadata"], "kinds.sparse_mla"),
    "ModelAttention": "model_attention",
    "AttentionOutput": "outputs",
    **dict.fromkeys(["ProbeReport", "probe"], "probe"),
    **dict.fromkeys(["Backend", "register"], "registry"),
    "AttentionSession": "session",
    "LayerSpec": "spec",
    **dict.fromkeys(["Checkpoint", "State", "Views"], "state"),
    **dict.fromkeys(["RequestState", "TransferTimeoutError"], "transfer"),
}

__all__ = [
    "PHASES", "Batch", "CursorAdvance", "Output", "StepDeltas", "Writes", "writes",
    "DoubleApplyError", "LeaseError", "NoBackendError", "OutsideSessionError", "PoolExhaustedError", "PurityError",
    "SessionClosedError", "StaleDeltasError", "StaleStateError",
    "StepMeta", "StorageDecl", "inputs", "kind", "kind_info", "known_kinds", "per_request", "per_token",
    "register_kind",
    "GDNConfig", "KDAConfig", "RecurrentInputs", "RecurrentOutput", "DSV4Config", "AttentionOutput",
    "FullAttentionConfig", "FullAttentionInputs", "MLAConfig", "MLAInputs", "IndexerConfig", "SparseAttentionOutput",
    "SparseMLAConfig", "SparseMLAInputs", "SparseQueryMetadata",
    "ModelAttention", "ProbeReport", "probe", "Backend", "register", "AttentionSession", "LayerSpec",
    "Checkpoint", "State", "Views", "RequestState", "TransferTimeoutError",
]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Every public name may look a built-in kind or backend up by name (`kind_info("full")`, `register`): they
    # are registered first. The core below them names no kind; this package, at the top, may.
    from . import kinds  # noqa: F401

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later uses are plain lookups
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Python binds a submodule to its package once it is imported; `probe` names both a module and
        # the function exported here, and must stay the function whichever is imported first.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
