"""FlashInfer's fused sampling kernels behind `Sampler(kernel="flashinfer")`, on the GPU.

They draw from their own Philox stream, so tokens are compared with the torch
path by distribution, not one by one: every token lies in the set the filters
keep, the same seed repeats, and over many rows the frequencies match the
torch path's probabilities.
"""

import pytest
import torch

from fnattn.generation import Sampler

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

FILTERS = [dict(), dict(top_k=8), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=20, top_p=0.9, min_p=0.05)]


def logits(rows=4096, vocab=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    one = torch.randn(1, vocab, device="cuda", generator=g) * 2  # one distribution, many draws of it
    return one.expand(rows, vocab).contiguous()


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f) or "plain")
def test_flashinfer_sampling_keeps_the_filtered_set_repeats_and_matches_the_distribution(filters):
    x = logits()
    fi = Sampler(temperature=0.8, seed=5, kernel="flashinfer", **filters)
    ref = Sampler(temperature=0.8, seed=5, kernel="torch", **filters)
    probs = ref.warp(x[:1]).softmax(-1)[0]  # [V] what the filters keep, renormalised
    a = fi.sample(x, fi.generator("cuda"))
    b = fi.sample(x, fi.generator("cuda"))
    assert torch.equal(a, b), "the same seed must give the same tokens"
    assert bool((probs[a] > 0).all()), "a token outside the filtered set was drawn"
    freq = torch.bincount(a, minlength=x.shape[1]).float() / x.shape[0]
    # 4096 draws: 4 standard deviations of a frequency is <= 0.032
    assert float((freq - probs).abs().max()) < 0.032


def test_greedy_is_argmax_and_auto_picks_flashinfer_on_cuda():
    x = logits(rows=8)
    assert torch.equal(Sampler(kernel="flashinfer").sample(x), x.argmax(-1))
    auto = Sampler(temperature=1.0, seed=1, kernel="auto")
    fi = Sampler(temperature=1.0, seed=1, kernel="flashinfer")
    assert torch.equal(auto.sample(x, auto.generator("cuda")), fi.sample(x, fi.generator("cuda")))
