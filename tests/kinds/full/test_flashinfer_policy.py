"""FlashInfer's decode configuration per step: tensor cores from batch 8 up with >= 4 query heads per K/V head."""

import pytest

from fnattn import FullAttentionConfig
from fnattn.kinds.full.flashinfer import use_tensor_cores


@pytest.mark.parametrize("hq, hkv, batch, want", [
    (32, 8, 1, False), (32, 8, 4, False), (32, 8, 8, True), (32, 8, 64, True),
    (8, 2, 32, True), (8, 8, 64, False), (16, 8, 256, False), (8, 1, 8, True), (8, 1, 7, False),
])
def test_tensor_cores_by_batch_and_gqa_ratio(hq, hkv, batch, want):
    assert use_tensor_cores(FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=128), batch) is want
