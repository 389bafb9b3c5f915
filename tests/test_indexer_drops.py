"""The sparse indexers once they drop entries: DeepSeek-V4's CSA and the DSA families (DeepSeek-V3.2, GLM-5).

Contexts hold several times the top-k (DeepSeek-V4: 10 and 17 compressed entries for a top-5; DSA: 40 and 70
tokens for a top-6), so most entries are dropped, against transformers in every phase; and, on our own paths,
a token's selection does not depend on how its prompt was split into steps or on what follows it.

The indexers' ReLU scores are often exactly equal (0). fnattn gives such ties to the earlier position;
transformers leaves them to ``torch.topk``, whose choice follows the length of the row it selects in, so its
own logits for a token change with the number of tokens after it. Parity therefore runs with transformers'
indexer top-k breaking ties the same way (`ties_to_earlier`); with few indexer heads ties are common, and a
config with many heads checks that without ties the two agree with transformers untouched.
"""

from __future__ import annotations

import pytest
import test_model_deepseek as dsa_hf
import test_model_deepseek_v4 as v4_hf
import torch
from fnattn.kernels.indexer import ordered_topk
from fnattn.models.registry import family_named, load_model, random_model
from hf_mla import ties_to_earlier
from transformers.cache_utils import DynamicCache

import fnattn as fa
from fnattn.driver import run_step
from fnattn.speculative import replay_writes

TOL = 1e-4
LENGTHS = (40, 70)
V4 = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, index_topk=5,
          sliding_window=8)
class Pair:
    """A transformers model with random weights and ours loaded from its checkpoint."""

    def __init__(self, hf, raw, tmp_path_factory, prefer=None):
        self.hf, self.raw = hf, raw
        path = tmp_path_factory.mktemp("drops")
        hf.save_pretrained(path)
        self.model = load_model(path)
        self.ma = fa.ModelAttention(self.model.specs, **({"prefer": prefer} if prefer else {}))

    def prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.raw["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()

    def hf_steps(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """transformers' logits of each chunk fed in turn through one cache."""
        cache = DynamicCache(config=self.hf.config)
        with torch.no_grad():
            return [self.hf(input_ids=torch.tensor([c]), cache=cache, use_cache=True).logits[0] for c in chunks]

    def hf_greedy(self, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
        """transformers alone: the prompt's logits, then ``steps`` greedy decodes' (one cache)."""
        cache = DynamicCache(config=self.hf.config)
        logits, tokens = [], []
        with torch.no_grad():
            for chunk in [prompt] + [None] * steps:
                ids = chunk if chunk is not None else tokens[-1:]
                logits.append(self.hf(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0])
                tokens.append(int(logits[-1][-1].argmax()))
        return logits, tokens

    def state(self):
        return fa.State(self.model.specs, num_pages=64, page_size=4, max_requests=1, recurrent_ring=2).admit(0)

    def run(self, st, batch, tokens):
        return run_step(self.model.step, self.model.params, self.ma, st, batch, torch.tensor(tokens))

    def prefill(self, st, tokens):
        st = st.reserve({0: len(tokens)})
        return self.run(st, fa.Batch.prefill(st, {0: len(tokens)}), tokens)

    def decode(self, st, token):
        st = st.reserve({0: 1})
        return self.run(st, fa.Batch.decode(st, [0]), [token])


def close(ours, theirs, what):
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.2e}"


def v4_pair(tmp_path_factory, index_heads: int, seed: int = 0, prefer=None) -> Pair:
    raw = v4_hf.tiny_raw(**V4, index_n_heads=index_heads)
    return Pair(v4_hf.hf_model(raw, seed), raw, tmp_path_factory, prefer)


def dsa_pair(name, tmp_path_factory, index_heads: int, prefer=None) -> Pair:
    raw = {**dsa_hf.tiny_raw(name), "index_n_heads": index_heads}
    config_cls, model_cls = dsa_hf.HF[name]
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kwargs, attn_implementation="eager", experts_implementation="eager")).eval()
    dsa_hf.randomize_(hf, 0)
    return Pair(hf, raw, tmp_path_factory, prefer)


# Two indexer heads: many exact ties. GLM-5's tiny config has shared-indexer layers (1 and 3 reuse 0's and 2's).
@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v32", "glm5"])
def pair(request, tmp_path_factory):
    if request.param == "deepseek_v4":
        return v4_pair(tmp_path_factory, index_heads=2)
    return dsa_pair(request.param, tmp_path_factory, index_heads=2)


def _topk_of(pair) -> int:
    return pair.raw["index_topk"]


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_then_decodes_match_hf_with_most_entries_dropped(pair, n):
    prompt = pair.prompt(n)
    visible = n // 4 if pair.raw["model_type"] == "deepseek_v4" else n
    assert visible >= 2 * _topk_of(pair)  # the indexer keeps well under half of what it could
    with ties_to_earlier():
        want, tokens = pair.hf_greedy(prompt, 2)
    st, logits = pair.prefill(pair.state(), prompt)
    close(logits, want[0], f"prefill of {n}")
    for i in range(2):
        st, logits = pair.decode(st, tokens[i])
        close(logits, want[i + 1], f"decode {i} after {n}")
        assert int(logits[-1].argmax()) == tokens[i + 1]


@pytest.mark.parametrize("chunks", [(13, 27), (29, 1, 40)])
def test_chunked_prefill_matches_hf_chunked_and_whole(pair, chunks):
    prompt = pair.prompt(sum(chunks))
    parts, done = [], 0
    for c in chunks:
        parts.append(prompt[done:done + c])
        done += c
    with ties_to_earlier():
        whole = pair.hf_steps([prompt])[0]
        hf_chunked = torch.cat(pair.hf_steps(parts))
    close(hf_chunked, whole, "transformers chunked against whole, ties to the earlier entry")
    st, outs = pair.state(), []
    for part in parts:
        st, logits = pair.prefill(st, part)
        outs.append(logits)
    close(torch.cat(outs), whole, f"chunked prefill {chunks}")


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_verify_over_many_entries_matches_hf(pair, recovery):
    """Verify 1 + 4 drafts after a 45-token prompt (11 DeepSeek-V4 entries, a window closing inside), keep 2,
    decode on."""
    prompt = pair.prompt(45)
    with ties_to_earlier():
        want, tokens = pair.hf_greedy(prompt, 5)
    st, _ = pair.prefill(pair.state(), prompt)
    st = st.reserve({0: 5})
    batch = fa.Batch.verify(st, [0], num_draft=4, recovery=recovery)
    with pair.ma.session(st, batch) as s:
        logits, deltas = pair.model.step(pair.model.params, s, torch.tensor(tokens[:5]))
    close(logits, torch.cat([want[i + 1] for i in range(5)]), "verify")
    replay = replay_writes(pair.ma, st, batch, s.replay_outputs, {0: 2}) if recovery == "replay" else None
    st = st.apply(deltas.accept(batch, {0: 2}, replay=replay))
    for i in range(2, 5):
        st, logits = pair.decode(st, tokens[i])
        close(logits, want[i + 1], f"decode {i} after accepting 2 of 5")


@pytest.mark.parametrize("n", LENGTHS)
def test_without_ties_deepseek_v4_matches_hf_untouched(tmp_path_factory, n):
    """Eight indexer heads leave no tie at the top-k boundary here (transformers gives the same logits with
    and without `ties_to_earlier`), and the whole prompt and a decode match transformers as it is."""
    pair = v4_pair(tmp_path_factory, index_heads=8)
    prompt = pair.prompt(n)
    plain = pair.hf_steps([prompt, [7]])
    with ties_to_earlier():
        ordered = pair.hf_steps([prompt, [7]])
    assert all(torch.equal(a, b) for a, b in zip(plain, ordered)), "a tie at the boundary: not tie-free"
    st, logits = pair.prefill(pair.state(), prompt)
    close(logits, plain[0], f"prefill of {n}")
    _, logits = pair.decode(st, 7)
    close(logits, plain[1], f"decode after {n}")


# --------------------------------------------------------------------------- our paths, without transformers


@pytest.mark.parametrize("name", ["deepseek_v4", "deepseek_v32", "glm5"])
@pytest.mark.parametrize("prefer", [("reference",), None], ids=["reference", "default"])
def test_selection_does_not_depend_on_the_split_or_what_follows(name, prefer):
    """One indexer head (ties everywhere): a whole 40-token prefill, a prefix then the rest (a cached prefix,
    start position > 0), a prefix then 1-token steps, and a token's logits as the last of its own prompt agree,
    selections included."""
    m = random_model(name, seed=3, config={**family_named(name).tiny_config(), "index_n_heads": 1})
    ma = fa.ModelAttention(m.specs, **({"prefer": prefer} if prefer else {}))
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0))

    def run(chunks):
        st = fa.State(m.specs, num_pages=64, page_size=4, max_requests=1).admit(0)
        outs, picks, done = [], [], 0
        for n in chunks:
            st = st.reserve({0: n})
            batch = fa.Batch.prefill(st, {0: n})
            with ma.session(st, batch) as s:
                logits, deltas = m.step(m.params, s, prompt[done:done + n])
                picks.append({k: v.clone() for k, v in s.generated.items()})
            st = st.apply(deltas)
            outs.append(logits)
            done += n
        return torch.cat(outs), picks

    whole, (whole_picks,) = run([40])
    for chunks in ([23, 17], [33, 1, 1, 1, 4]):
        got, picks = run(chunks)
        torch.testing.assert_close(got, whole, atol=1e-5, rtol=0, msg=f"chunks {chunks[:3]}...")
        for name_ in whole_picks:  # DeepSeek-V4 records its top-k lanes; both sets are the same entries
            split = torch.cat([p[name_] for p in picks])
            assert torch.equal(split.sort(dim=-1).values, whole_picks[name_].sort(dim=-1).values), name_
    for t in (27,):  # the token's logits as the last of its own prompt: nothing after it counts
        alone, _ = run([t + 1])
        torch.testing.assert_close(alone[-1], whole[t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_window_and_sinks_stay_whatever_the_top_k_drops(backend):
    """A CSA layer with a top-2 over 17 entries and index weights that make every score 0 or below: the
    window and the sinks are attended by every token alongside the two picks (the oracle of
    tests/kinds/dsv4 lays out window + picks + sinks for each token), for a prefill, a cached prefix + rest
    and decodes."""
    import kinds.dsv4.test_reference as oracle_tests

    c = oracle_tests.CONFIGS["csa"]
    s = oracle_tests.Stream(c, 70, 11)
    s.iw = -s.iw.abs()  # negative head weights: the best scores are the exact zeros, ties everywhere
    s.sinks = torch.full_like(s.sinks, 2.0)  # sinks that hold real mass
    want = oracle_tests.oracle(s, 70)
    specs = (fa.LayerSpec(0, c, torch.float32),)
    ma = fa.ModelAttention(specs, prefer=(backend,))
    for chunks in ([70], [37, 33], [60] + [1] * 10):
        st = fa.State(specs, num_pages=40, page_size=4, max_requests=1, fill=float("nan")).admit(0)
        outs = []
        for i, n in enumerate(chunks):
            phase = "decode" if i and n == 1 else "prefill"
            st, o = oracle_tests.feed(st, ma, {0: s}, {0: n}, phase=phase)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=0, msg=f"{backend} {chunks[:2]}")


def test_ordered_topk_ranks_by_score_then_earlier_position():
    """Ties (0.0 and -0.0 alike) go to the earlier position, -inf ranks last, and a row's picks among its
    first entries do not change when -inf padding or more entries follow (torch.topk's may)."""
    s = torch.tensor([[0.0, -0.0, 1.0, -1.0, float("-inf"), 0.0, 2.0, -0.5]])
    assert ordered_topk(s, 5).tolist() == [[6, 2, 0, 1, 5]]
    assert ordered_topk(s, 8).tolist() == [[6, 2, 0, 1, 5, 7, 3, 4]]
    assert ordered_topk(s, 4, best_first=False).sort().values.tolist() == [[0, 1, 2, 6]]
    zeros = torch.zeros(3, 40)
    zeros[1].neg_()  # -0.0 everywhere
    padded = torch.cat((zeros, torch.full((3, 300), float("-inf"))), dim=1)
    assert ordered_topk(zeros, 5).tolist() == [list(range(5))] * 3 == ordered_topk(padded, 5).tolist()
    x = torch.randn(20, 300).clamp(min=0)  # about half exactly 0
    assert torch.equal(ordered_topk(x, 200), x.sort(dim=-1, descending=True, stable=True).indices[:, :200])


@pytest.mark.parametrize("seed", range(4))
def test_ordered_topk_is_a_stable_sorts_head_for_any_row_and_k(seed):
    """Rows with many equal scores (0.0, -0.0, -inf) and every k from 1 to the row's length: best first, the
    head of a stable descending sort; unsorted, the same set."""
    g = torch.Generator().manual_seed(seed)
    T, N = 3, 1 + 97 * seed
    x = torch.randn(T, N, generator=g).clamp(min=0)
    x = torch.where(torch.rand(T, N, generator=g) < 0.2, torch.full_like(x, float("-inf")), x)
    x = torch.where(torch.rand(T, N, generator=g) < 0.1, -x, x)
    want = x.sort(dim=-1, descending=True, stable=True).indices
    for k in sorted({k for k in (1, 2, N // 3 + 1, N // 2 + 1, N - 1, N) if 1 <= k <= N}):
        assert torch.equal(ordered_topk(x, k), want[:, :k]), k
        assert torch.equal(ordered_topk(x, k, best_first=False).sort().values, want[:, :k].sort().values), k


@pytest.mark.gpu
def test_gpu_indexer_breaks_ties_like_the_reference():
    """On CUDA: the Triton DSA indexer's top-k over a padded block table and DeepSeek-V4's batched decode
    top-k pick the earliest of equal scores, as the CPU references do."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fnattn.kernels.indexer import indexer_topk

    from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices

    dev, Hi, Di, S, n = "cuda", 2, 32, 16, 70
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, Hi, Di, generator=g)
    w = -torch.rand(n, Hi, generator=g)  # non-positive weights: the best scores are the exact zeros
    k = torch.randn(n, Di, generator=g)
    want = topk_indices(indexer_scores(q, w, k), n_cached=0, topk=6)
    pages = torch.zeros(8, S, Di)
    table = torch.arange(1, 8, dtype=torch.int32)[None]  # 112 positions for 70 tokens: padded rows
    got = indexer_topk(q.to(dev), w.to(dev), pages.to(dev), k.to(dev), table.to(dev),
                       torch.zeros(n, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                       torch.tensor([0, n], dtype=torch.int32, device=dev), torch.arange(n, device=dev),
                       scale=Di ** -0.5, topk=6)
    assert torch.equal(got.cpu().sort(dim=-1).values, want.sort(dim=-1).values)
