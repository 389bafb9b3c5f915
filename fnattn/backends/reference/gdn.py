"""Reference Gated DeltaNet (Qwen3.5 / Qwen3-Next) backends: prefill, decode, verify.

The math is shared with KDA in `recurrent.py`; one function per phase, as
the registry wants.
"""

from __future__ import annotations

from ...registry import register
from .recurrent import per_request, per_token


@register("gdn", "prefill", "reference")
def gdn_prefill(spec, views, inputs):
    return per_request(spec, views, inputs, chunked=True)


@register("gdn", "decode", "reference")
def gdn_decode(spec, views, inputs):
    return per_request(spec, views, inputs, chunked=False)


@register("gdn", "verify", "reference")
def gdn_verify(spec, views, inputs):
    return per_token(spec, views, inputs)
