"""fnattn: attention for LLM inference as pure functions.

Every backend is ``backend(spec, views, inputs) -> (outputs, writes)``; a
driver applies the writes of a step once, with `State.apply`.
"""

import os as _os

# In a source checkout that was not installed (a notebook or a GPU box at the repo
# root), kernels/ and models/ sit beside fnattn/; an install maps them into the
# package instead. Only a checkout (pyproject.toml beside) gets the extra path.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own search path

from .batch import PHASES, Batch
from .declare import StepMeta, StorageDecl, inputs, kind, kind_info, known_kinds, per_request, per_token, register_kind
from .deltas import CursorAdvance, Output, StepDeltas, Writes, writes
from .errors import (
    DoubleApplyError,
    LeaseError,
    NoBackendError,
    OutsideSessionError,
    PoolExhaustedError,
    PurityError,
    SessionClosedError,
    StaleDeltasError,
    StaleStateError,
)
from .kinds.delta_rule import GDNConfig, KDAConfig, RecurrentInputs, RecurrentOutput
from .kinds.dsv4 import DSV4Config
from .kinds.full import AttentionOutput, FullAttentionConfig, FullAttentionInputs
from .kinds.mla import MLAConfig, MLAInputs
from .kinds.sparse_mla import (
    IndexerConfig,
    SparseAttentionOutput,
    SparseMLAConfig,
    SparseMLAInputs,
    SparseQueryMetadata,
)
from .model_attention import ModelAttention
from .probe import ProbeReport, probe
from .registry import Backend, register
from .session import AttentionSession
from .spec import LayerSpec
from .state import Checkpoint, State, Views
from .transfer import RequestState, TransferTimeoutError

__version__ = "0.1.0"

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
