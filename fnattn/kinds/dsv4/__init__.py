"""DeepSeek-V4 compressed attention: sliding window plus a c4 (indexed) or c128 compressed branch.

Only the config exists so far: model adapters can describe the layers, and a
`State` refuses them with a clear error until storage and backends land.
"""

from ...declare import register_kind
from .config import DSV4Config

register_kind("dsv4", config=DSV4Config, inputs=())

__all__ = ["DSV4Config"]
