"""fnattn: attention for LLM inference as pure functions.

Every backend is ``backend(spec, views, inputs) -> (outputs, deltas)``; a
driver applies a step's deltas once, with `State.apply`.
"""

import os as _os

from .batch import PHASES, Batch
from .deltas import CursorAdvance, IndexKeyWrite, KVWrite, LatentWrite, RecurrentWrite, StepDeltas
from .errors import (
    DoubleApplyError,
    LeaseError,
    NoBackendError,
    PoolExhaustedError,
    SessionClosedError,
    StaleDeltasError,
    StaleStateError,
)
from .inputs import (
    AttentionOutput,
    FullAttentionInputs,
    MLAInputs,
    RecurrentInputs,
    RecurrentOutput,
    SparseAttentionOutput,
    SparseMLAInputs,
    SparseQueryMetadata,
    StepMeta,
)
from .model_attention import ModelAttention
from .probe import ProbeReport, probe
from .registry import Backend, register
from .session import AttentionSession
from .spec import (
    DSV4Config,
    FullAttentionConfig,
    GDNConfig,
    IndexerConfig,
    KDAConfig,
    LayerSpec,
    MLAConfig,
    SparseMLAConfig,
)
from .state import Checkpoint, State, Views

__version__ = "0.1.0"

__all__ = [
    "PHASES", "Batch", "CursorAdvance", "IndexKeyWrite", "KVWrite", "LatentWrite", "RecurrentWrite",
    "StepDeltas", "DoubleApplyError", "LeaseError", "NoBackendError", "PoolExhaustedError",
    "SessionClosedError", "StaleDeltasError", "StaleStateError", "AttentionOutput", "FullAttentionInputs",
    "MLAInputs", "RecurrentInputs", "RecurrentOutput", "SparseAttentionOutput", "SparseMLAInputs",
    "SparseQueryMetadata", "StepMeta", "ModelAttention", "ProbeReport", "probe", "Backend", "register",
    "AttentionSession",
    "DSV4Config", "FullAttentionConfig", "GDNConfig", "IndexerConfig", "KDAConfig", "LayerSpec", "MLAConfig",
    "SparseMLAConfig", "Checkpoint", "State", "Views",
]

# In a source checkout that was not installed (a notebook or a GPU box at the repo
# root), kernels/ and models/ sit beside fnattn/; an install maps them into the
# package instead. Only a checkout (pyproject.toml beside) gets the extra path.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own search path
