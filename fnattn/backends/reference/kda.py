"""Reference Kimi Delta Attention (Kimi Linear) backends: prefill, decode, verify.

The math is shared with GDN in `recurrent.py`; one function per phase, as
the registry wants.
"""

from __future__ import annotations

from ...registry import register
from .recurrent import per_request, per_token


@register("kda", "prefill", "reference")
def kda_prefill(spec, views, inputs):
    return per_request(spec, views, inputs, chunked=True)


@register("kda", "decode", "reference")
def kda_decode(spec, views, inputs):
    return per_request(spec, views, inputs, chunked=False)


@register("kda", "verify", "reference")
def kda_verify(spec, views, inputs):
    return per_token(spec, views, inputs)
