import dataclasses

import optree
import pytest
import torch

import fnattn as fa


def test_configs_are_frozen_hashable_and_default_their_scale():
    c = fa.FullAttentionConfig(num_q_heads=8, num_kv_heads=2, head_dim=64)
    assert c.head_dim_v == 64 and c.scale == pytest.approx(64**-0.5) and c.group_size == 4
    assert hash(c) == hash(fa.FullAttentionConfig(num_q_heads=8, num_kv_heads=2, head_dim=64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.head_dim = 32
    spec = fa.LayerSpec(index=3, config=c)
    assert spec.kind == "full" and {spec: 1}[fa.LayerSpec(index=3, config=c)] == 1


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: fa.FullAttentionConfig(num_q_heads=6, num_kv_heads=4, head_dim=64), "num_q_heads"),
        (lambda: fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=0, head_dim=64), "num_kv_heads"),
        (lambda: fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=4, head_dim=-1), "head_dim"),
        (lambda: fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=4, head_dim=8, sliding_window=-2),
         "sliding_window"),
        (lambda: fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=4, head_dim=8, scale=0.0), "scale"),
        (lambda: fa.MLAConfig(num_heads=4, kv_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
         "kv_lora_rank"),
        (lambda: fa.IndexerConfig(num_heads=2, head_dim=16, topk=0), "topk"),
        (lambda: fa.IndexerConfig(num_heads=2, head_dim=16, topk=4, rope_head_dim=32), "rope_head_dim"),
        (lambda: fa.GDNConfig(num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8), "num_v_heads"),
        (lambda: fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=1), "conv_kernel"),
        (lambda: fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, state_dtype=torch.int8),
         "state_dtype"),
        (lambda: fa.KDAConfig(num_heads=0, head_k_dim=8, head_v_dim=8), "num_heads"),
        (lambda: fa.DSV4Config(num_heads=4, head_dim=64, qk_rope_head_dim=16, sliding_window=128, compress_ratio=8),
         "compress_ratio"),
        (lambda: fa.DSV4Config(num_heads=4, head_dim=64, qk_rope_head_dim=16, sliding_window=128, compress_ratio=4),
         "indexer"),
        (lambda: fa.LayerSpec(index=-1, config=fa.KDAConfig(num_heads=2, head_k_dim=8, head_v_dim=8)), "index"),
        (lambda: fa.LayerSpec(index=0, config={"num_heads": 2}), "config"),
        (lambda: fa.LayerSpec(index=0, config=fa.KDAConfig(num_heads=2, head_k_dim=8, head_v_dim=8),
                              dtype=torch.int32), "dtype"),
    ],
)
def test_invariants_name_the_field(build, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        build()


def test_every_kind_builds_and_flattens_to_no_leaves():
    idx = fa.IndexerConfig(num_heads=2, head_dim=16, topk=8, rope_head_dim=8)
    mla = fa.MLAConfig(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    configs = [
        fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=1, head_dim=8, sliding_window=16, softcap=30.0, sinks=True),
        mla,
        fa.SparseMLAConfig(mla=mla, indexer=idx, index_source_layer=2),
        fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16),
        fa.KDAConfig(num_heads=2, head_k_dim=8, head_v_dim=8),
        fa.DSV4Config(num_heads=4, head_dim=64, qk_rope_head_dim=16, sliding_window=128, compress_ratio=4, indexer=idx),
        fa.DSV4Config(num_heads=4, head_dim=64, qk_rope_head_dim=16, sliding_window=128, compress_ratio=128),
    ]
    for i, c in enumerate(configs):
        spec = fa.LayerSpec(index=i, config=c)
        leaves, tree = optree.tree_flatten(spec, namespace="fnattn")
        assert leaves == []
        assert optree.tree_unflatten(tree, leaves) == spec
    assert configs[0].kind == "full" and configs[5].kind == "dsv4"
