"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's MLA + DSA with top-k shared across layers.

Layers whose ``indexer_types`` entry is ``"shared"`` run no indexer: they own
no indexer weights and no index-key cache, and attend with the top-k chosen by
the closest earlier ``"full"`` layer in the same step. The indexer's rope is
interleaved (DeepSeek-V3.2's is half-split). Everything else (MLA, routing,
dense-layer schedule, loading, the step) is DeepSeek-V3.2's, from
`models.deepseek_v32`.
"""

from __future__ import annotations

from . import deepseek_v32 as ds
from .dsa_layer import glm_indexer_types, topk_source_layers
from .registry import Family, register_family


def adapt(raw: dict) -> ds.DeepseekConfig:
    ds.get_field(raw, "num_hidden_layers", "int")  # checked before the indexer pattern is derived from it
    types = glm_indexer_types(raw)
    topk_source_layers(types)  # a shared layer needs an earlier full layer; raises naming the layer
    return ds.adapt_config(raw, model_type="glm_moe_dsa", indexer_types=types)


def tiny_config() -> dict:
    """Four layers: full and shared indexers, one dense MLP then MoE."""
    raw = ds.tiny_config("glm_moe_dsa")
    raw.update(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"], rms_norm_eps=1e-5)
    return raw


register_family(Family(name="glm5", model_types=("glm_moe_dsa",), adapt=adapt, weight_shapes=ds.weight_shapes,
                       load=ds.load, step=ds.step, tiny_config=tiny_config,
                       step_hidden=ds.step_hidden, draft=ds.draft, generated_lanes=ds.generated_lanes))
