"""Built-in backends. Importing this package registers all of them.

Fast backends import their GPU libraries only when called, and refuse a layer
(with reasons) through their ``supports`` predicate when a device or library
is missing.
"""

from . import flashinfer_full, triton_full, triton_recurrent  # noqa: F401
from .reference import (
    full,  # noqa: F401
    gdn,  # noqa: F401
    kda,  # noqa: F401
    mla,  # noqa: F401
    sparse_mla,  # noqa: F401
)
