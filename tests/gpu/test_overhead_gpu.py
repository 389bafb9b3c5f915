"""`fnattn bench overhead` on the GPU: each way runs the same step. The direct graph way replays a second
runner's capture of it with none of the runner's checks; its logits must equal the graph way's bit for bit
in every round (the same kernels over the same State contents), and every way's records must be there."""

import pytest
import torch

from fnattn.bench.overhead import run_overhead_bench

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 3])
def test_overhead_ways_on_the_gpu(batch, record):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    records = run_overhead_bench(family="qwen3_5", shape="tiny", batches=[batch], prompts=[40], steps=4,
                                 device="cuda", log=lambda line: None)
    by_way = {r["backend"]: r for r in records}
    assert set(by_way) == {"direct", "fnattn session", "fnattn graph", "direct graph"}
    graph, replayed = by_way["fnattn graph"], by_way["direct graph"]
    ok = replayed["logits_equal_graph"] and graph["captured"] and graph["graph_overhead"] > 0 \
        and replayed["host_before_replay_us"] > 0 and graph["host_before_replay_us"] > 0 \
        and graph["prepared_steps"] > 0
    record({"case": f"overhead ways qwen3_5 tiny B{batch}", "ok": bool(ok),
            "graph_overhead": graph["graph_overhead"], "host_before_replay_us": replayed["host_before_replay_us"],
            "logits_equal_graph": replayed["logits_equal_graph"], "prepared_steps": graph["prepared_steps"]})
    assert ok, (graph, replayed)
