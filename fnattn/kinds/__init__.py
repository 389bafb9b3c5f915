"""The built-in attention kinds, one package each; importing this registers them all.

Each package holds its kind's whole story: the frozen config with its storage
declaration, the inputs and outputs, the reference backend per phase and the
fast backends (which import their GPU libraries only when called).
"""

from . import delta_rule, dsv4, full, mla, sparse_mla  # noqa: F401
