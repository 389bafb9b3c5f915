"""FlashMLA, FlashInfer-MLA and the sparse FlashMLA path against the references on a GPU.

Layer shapes: DeepSeek-V3.2 / GLM-5's real one (128 heads, 512 + 64 latent, 128 + 128 nope / value dims,
64 indexer heads of 128, top-k 2048) and tiny ones with the same latent (FlashMLA's only) but few heads,
padded to 64 on the model side. Caches hold rows of different lengths (0, 1, page multiples and not),
every phase runs with a prefix, verify with k = 1..4, BF16 and the per-tensor FP8 cache, pad lanes,
and several decode steps in a row at batch > 1. Last, whole tiny DeepSeek-V3 / V3.2 / GLM-5 models
through the fast paths against the reference path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kinds.mla.fast_cases import compare, filled_state, forward_all, mla_config, sparse_specs

import fnattn as fa

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 operands: max |err| / max |ref| over the model's own heads
DEV = "cuda"

REAL = dict(H=128, R=512, Dr=64, Dn=128, Dv=128)
TINY = dict(H=16, R=512, Dr=64, Dn=64, Dv=64)
TINY_PADDED = dict(H=4, padded=64, R=512, Dr=64, Dn=64, Dv=64)
CACHED = [0, 1, 63, 64, 130, 1000]  # lengths 0 and 1, page multiples and not


def _check(rows, label, record, *, tol=TOL, topk_tol=0.02):
    for r in rows:
        ok = r["finite"] and r["o_rel"] <= tol and r["writes_equal"] and r.get("topk_mismatch", 0.0) <= topk_tol
        record({"case": label, **r, "ok": ok})
        assert ok, f"{label}: {r}"


def _batch(st, phase, ids, k=0, pad=0):
    if phase == "decode":
        return fa.Batch.decode(st, ids, pad_to=len(ids) + pad) if pad else fa.Batch.decode(st, ids)
    if phase == "verify":
        return (fa.Batch.verify(st, ids, num_draft=k, pad_to=len(ids) + pad) if pad
                else fa.Batch.verify(st, ids, num_draft=k))
    raise ValueError(phase)


def _live(batch):
    """Tokens of admitted requests (pad lanes' outputs are dropped by the caller)."""
    lanes = torch.tensor([r >= 0 for r in batch.request_ids], device=DEV)
    return lanes.repeat_interleave(torch.tensor(batch.host_new_lens, device=DEV))


# --------------------------------------------------------------------------- dense MLA


@pytest.mark.parametrize("shape", ["tiny", "tiny_padded", "real"])
@pytest.mark.parametrize("phase, k", [("decode", 0), ("verify", 1), ("verify", 2), ("verify", 3), ("verify", 4)])
@pytest.mark.parametrize("backend, page", [("flashmla", 64), ("flashinfer", 64), ("flashinfer", 16)])
def test_dense_mla_matches_reference(shape, phase, k, backend, page, record):
    if backend == "flashinfer" and (shape == "tiny" or k in (2, 3)):
        pytest.skip("FlashInfer compiles per variant: its matrix is padded/real heads, k in 0, 1, 4")
    cfg = mla_config(**{"tiny": TINY, "tiny_padded": TINY_PADDED, "real": REAL}[shape])
    spec = fa.LayerSpec(0, cfg, torch.bfloat16)
    st = filled_state([spec], CACHED, page_size=page, device=DEV)
    b = _batch(st, phase, list(range(len(CACHED))), k)
    _check(compare([spec], st, b, backend, seed=k), f"mla {shape} {phase} k{k} {backend} p{page}", record)


@pytest.mark.parametrize("backend", ["flashmla", "flashinfer"])
def test_dense_pad_lanes_stay_out_of_live_lanes(backend, record):
    spec = fa.LayerSpec(0, mla_config(**TINY_PADDED), torch.bfloat16)
    st = filled_state([spec], [5, 70, 200], page_size=64, device=DEV)
    for phase, k in (("decode", 0), ("verify", 2)):
        b = _batch(st, phase, [0, 1, 2], k, pad=3)
        _check(compare([spec], st, b, backend, seed=5, live=_live(b)), f"mla pad lanes {phase} {backend}", record)


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_fp8_cache_through_flashinfer_and_refused_by_flashmla(scale, record):
    spec = fa.LayerSpec(0, mla_config(**REAL, cache_dtype="fp8_e4m3", cache_scale=scale), torch.bfloat16)
    ma = fa.ModelAttention([spec], device=DEV, phases=("decode",))
    assert ma.backend(0, "decode").name == "flashinfer", ma.explain()
    assert "flashmla" in ma.explain() and "FP8" in ma.explain()
    st = filled_state([spec], CACHED, page_size=64, device=DEV)
    for phase, k in (("decode", 0), ("verify", 1), ("verify", 4)):
        b = _batch(st, phase, list(range(len(CACHED))), k)
        _check(compare([spec], st, b, "flashinfer", seed=k), f"mla fp8 scale{scale} {phase} k{k}", record)


@pytest.mark.parametrize("backend", ["flashmla", "flashinfer"])
def test_multi_step_decode_at_batch_above_one(backend, record):
    """Several decode steps in a row, each step's writes applied, fast and reference side by side."""
    spec = fa.LayerSpec(0, mla_config(**TINY_PADDED), torch.bfloat16)
    cached = [3, 64, 127, 500]
    fast, ref = (filled_state([spec], cached, page_size=64, extra=12, device=DEV) for _ in range(2))
    fm = fa.ModelAttention([spec], prefer=(backend,), device=DEV, phases=("decode",))
    rm = fa.ModelAttention([spec], prefer=("reference",), device=DEV, phases=("decode",))
    for step in range(8):
        bf, br = fa.Batch.decode(fast, range(4)), fa.Batch.decode(ref, range(4))
        of, df = forward_all(fm, fast, bf, [spec], seed=100 + step)
        orf, dr = forward_all(rm, ref, br, [spec], seed=100 + step)
        fast, ref = fast.apply(df), ref.apply(dr)
        err = float((of[0].o.float() - orf[0].o.float()).abs().max() / orf[0].o.float().abs().max())
        ok = bool(torch.isfinite(of[0].o).all()) and err <= TOL
        record({"case": f"mla multi-step {backend} step {step}", "o_rel": err, "ok": ok})
        assert ok, f"step {step}: {err}"


# --------------------------------------------------------------------------- sparse MLA


SPARSE = {  # name -> (layer shape, indexer heads, top-k, cached lengths)
    "tiny": (TINY_PADDED, 8, 16, [0, 1, 20, 63, 130]),
    "real": (dict(REAL), 64, 2048, [1, 100, 2100, 3000]),
}


@pytest.mark.parametrize("family", ["v32", "glm5"])
@pytest.mark.parametrize("shape", ["tiny", "real"])
@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 1), ("verify", 2), ("verify", 3),
                                      ("verify", 4)])
@pytest.mark.parametrize("one_pass", [False, True], ids=["", "one-pass slots"])
def test_sparse_mla_matches_reference(family, shape, phase, k, one_pass, record):
    """``one_pass``: the top-k positions translated by `fnattn.kernels.topk_slots` (`one_pass_slots`)."""
    from fnattn.kinds.sparse_mla.flashmla import one_pass_slots

    with one_pass_slots(one_pass):
        _sparse_case(family, shape, phase, k, " one-pass" if one_pass else "", record)


@pytest.mark.parametrize("shape", ["tiny", "real"])
@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 2)])
def test_sparse_mla_with_fp8_index_keys_matches_reference(shape, phase, k, record):
    """FP8 index keys (`IndexerConfig.key_dtype`): the Triton indexer reads the stored e4m3 keys and their
    scales; the reference scores the dequantized keys; the same picks (within the usual tie tolerance)."""
    _sparse_case("v32", shape, phase, k, " fp8 index keys", record, key_dtype="fp8_e4m3")


@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 2)])
@pytest.mark.parametrize("key_dtype", [None, "fp8_e4m3"], ids=["bf16 keys", "fp8 keys"])
def test_sparse_mla_with_radix_select_matches_reference(phase, k, key_dtype, record):
    """`radix_select`: the real shape's top-k 2048 through sgl_kernel's radix select, the same picks as the
    reference's ``torch.topk`` (within the usual tie tolerance) and the same attention."""
    from fnattn.kinds.sparse_mla.flashmla import radix_select

    with radix_select(True):
        _sparse_case("v32", "real", phase, k, f" radix select{' fp8 keys' if key_dtype else ''}", record,
                     key_dtype=key_dtype)


@pytest.mark.parametrize("spread", ["normal", "narrow"])
def test_radix_topk_sets(spread, record):
    """`kernels.radix_topk` against ``torch.topk`` over scores whose rows see 1 .. 32768 positions: the same set
    where the scores spread out, every row sorted latest first with -1 after, the same bits twice. ``narrow``:
    every score in [1, 1.1), one bin of the kernel's first pass for all 32768 (more than the 16384 it holds):
    the picks may differ from torch's there, and from one run to the next (which 16384 it keeps is the order its
    threads arrive in), but are distinct visible positions, 2048 of them."""
    from fnattn.kernels.indexer import finite_topk, radix_topk

    g = torch.Generator(device=DEV).manual_seed(7)
    N, lengths = 32768, [1, 100, 2048, 2049, 5000, 20000, 32768]
    positions = torch.tensor([n - 1 for n in lengths], device=DEV)
    j = torch.arange(N, device=DEV)
    if spread == "normal":
        scores = torch.randn(len(lengths), N, device=DEV, generator=g) * 3
    else:
        scores = 1 + 0.1 * torch.rand(len(lengths), N, device=DEV, generator=g)
    scores = scores.masked_fill(j[None, :] > positions[:, None], float("-inf"))
    got, again = radix_topk(scores, positions, 2048), radix_topk(scores, positions, 2048)
    want = finite_topk(scores, 2048)
    ordered = bool(((got[:, :-1] > got[:, 1:]) | (got[:, 1:] == -1)).all())  # distinct, latest first, -1 last
    kept = (got >= 0).sum(dim=1)
    counts_ok = bool(torch.equal(kept, torch.tensor([min(n, 2048) for n in lengths], device=DEV)))
    visible = bool(((got < positions[:, None] + 1) | (got == -1)).all())
    same = bool(torch.equal(got.sort(dim=1).values, want.sort(dim=1).values))
    repeated = bool(torch.equal(got, again))
    ok = ordered and counts_ok and visible and ((same and repeated) or spread == "narrow")
    record({"case": f"radix_topk {spread} scores", "same_set_as_torch": same, "same_twice": repeated,
            "ordered": ordered, "counts_ok": counts_ok, "visible": visible, "ok": ok})
    assert ok, f"same {same}, twice {repeated}, ordered {ordered}, counts {kept.tolist()}, visible {visible}"


def _sparse_case(family, shape, phase, k, what, record, key_dtype=None):
    layer, Hi, topk, cached = SPARSE[shape]
    specs = sparse_specs(topk=topk, Hi=Hi, Di=128, shared=family == "glm5", key_dtype=key_dtype, **layer)
    page = 64 if family == "v32" else 16
    extra = 300 if phase == "prefill" else 8
    st = filled_state(specs, cached, page_size=page, extra=extra, device=DEV)
    ids = list(range(len(cached)))
    if phase == "prefill":
        b = fa.Batch.prefill(st, {r: n for r, n in zip(ids, [5, 1, 37, 300, 64][: len(ids)])})
    else:
        b = _batch(st, phase, ids, k)
    _check(compare(specs, st, b, "flashmla", seed=k), f"sparse {family} {shape} {phase} k{k}{what}", record)


def test_sparse_pad_lanes_and_multi_step_decode(record):
    specs = sparse_specs(topk=16, Hi=8, Di=128, shared=True, **TINY_PADDED)
    fast, ref = (filled_state(specs, [2, 40, 90], page_size=16, extra=12, device=DEV) for _ in range(2))
    b = _batch(fast, "decode", [0, 1, 2], pad=2)
    _check(compare(specs, fast, b, "flashmla", seed=9, live=_live(b)), "sparse pad lanes", record)
    fm = fa.ModelAttention(specs, prefer=("flashmla",), device=DEV, phases=("decode",))
    rm = fa.ModelAttention(specs, prefer=("reference",), device=DEV, phases=("decode",))
    for step in range(8):
        of, df = forward_all(fm, fast, fa.Batch.decode(fast, range(3)), specs, seed=200 + step)
        orf, dr = forward_all(rm, ref, fa.Batch.decode(ref, range(3)), specs, seed=200 + step)
        fast, ref = fast.apply(df), ref.apply(dr)
        for layer in (0, 1):
            err = float((of[layer].o.float() - orf[layer].o.float()).abs().max() / orf[layer].o.float().abs().max())
            ok = bool(torch.isfinite(of[layer].o).all()) and err <= TOL
            record({"case": f"sparse multi-step step {step} layer {layer}", "o_rel": err, "ok": ok})
            assert ok, f"step {step} layer {layer}: {err}"


def test_sparse_refusals_on_the_gpu():
    (unpadded,) = sparse_specs(topk=16, H=16, R=512, Dr=64, Dn=64, Dv=64)
    ma = fa.ModelAttention([unpadded], device=DEV)
    assert ma.backend(0, "decode").name == "reference" and "padded_heads" in ma.explain()
    (fp8,) = sparse_specs(topk=16, **TINY_PADDED, cache_dtype="fp8_e4m3")
    assert "656-byte" in fa.ModelAttention([fp8], device=DEV).explain()


# --------------------------------------------------------------------------- whole models


def _tiny_model(name, topk):
    from fnattn.models.registry import family_named, random_model

    raw = family_named(name).tiny_config()
    raw.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)
    if name != "deepseek_v3":
        # 32 indexer heads: a score is exactly 0 (every head's relu 0) with odds 2^-32, so the fast and the
        # reference top-k never face exact ties, which either may break its own way
        raw.update(index_head_dim=128, index_topk=topk, index_n_heads=32)
    model = random_model(name, dtype=torch.bfloat16, device=DEV, config=raw)
    params = dataclasses.replace(model.params, config=dataclasses.replace(model.config, padded_heads=64))
    return model, params


class Recording:
    """A session that keeps every layer's top-k (the model step sees the session it wraps)."""

    def __init__(self, session):
        self.session, self.topk = session, {}

    def __getattr__(self, name):
        return getattr(self.session, name)

    def forward(self, layer, inputs):
        out, deltas = self.session.forward(layer, inputs)
        if hasattr(out, "topk_indices"):
            self.topk[layer] = out.topk_indices.sort(dim=1).values
        return out, deltas


def _model_run(model, params, ma):
    specs = params.config.specs
    st = fa.State(specs, num_pages=16, page_size=64, max_requests=3, device=DEV, fill=float("nan"))
    st = st.admit(0).admit(1).admit(2).reserve({0: 90, 1: 90, 2: 90})
    g = torch.Generator().manual_seed(0)
    batches = [(fa.Batch.prefill, {0: 40, 1: 3, 2: 70})] + [(fa.Batch.decode, [0, 1, 2])] * 4
    logits, first_topk = [], []
    for make, arg in batches:
        b = make(st, arg)
        with ma.session(st, b) as s:
            rec = Recording(s)
            out, deltas = model.step(params, rec, torch.randint(0, 150, (b.num_tokens,), generator=g).to(DEV))
        st = st.apply(deltas)
        logits.append(out.float())
        if 0 in rec.topk:
            first_topk.append(rec.topk[0])
    return torch.cat(logits), first_topk


@pytest.mark.parametrize("name, topk", [("deepseek_v3", None), ("deepseek_v32", 512), ("glm5", 512),
                                        ("deepseek_v32", 8), ("glm5", 8)])
def test_tiny_model_logits_through_the_fast_paths(name, topk, record):
    """Logits through the fast paths match the reference path. With top-k >= the context every layer
    attends every visible token, so the logits must agree to bf16 rounding. With a small top-k a
    rounding-level change of a layer's input can flip which token is 8th best in later layers (a
    0.4% perturbation of the attention output moves the logits by 10% here, in the reference alone):
    then the first layer, whose inputs are the same on both paths, must select the same tokens, and
    the greedy tokens must agree."""
    model, params = _tiny_model(name, topk)
    specs = params.config.specs
    fast = fa.ModelAttention(specs, device=DEV)
    assert {fast.backend(s.index, p).name for s in specs for p in ("decode", "verify")} == {"flashmla"}, \
        fast.explain()
    f, ft = _model_run(model, params, fast)
    r, rt = _model_run(model, params, fa.ModelAttention(specs, prefer=("reference",), device=DEV))
    err = float((f - r).abs().max() / r.abs().max())
    agree = float((f.argmax(-1) == r.argmax(-1)).float().mean())
    same_first = float(torch.cat([(a == b).all(dim=1) for a, b in zip(ft, rt)]).float().mean()) if ft else 1.0
    strict = topk is None or topk >= 120
    ok = bool(torch.isfinite(f).all()) and (err <= 5e-2 if strict else (same_first >= 0.99 and agree >= 0.95))
    record({"case": f"model {name} topk {topk} padded 64", "logits_rel": err, "argmax_agree": agree,
            "first_layer_topk_same": same_first, "ok": ok})
    assert ok, f"{name} topk {topk}: rel {err:.3e}, argmax agreement {agree:.2f}, layer-0 top-k same {same_first:.3f}"


def test_sparse_bench_layers_agree(record):
    """The sparse bench's rows do the same work: the usual layer over precomputed slots, the usual layer that
    translates the top-k each step and fnattn's layer give the same output (the two usual ones bit for bit)."""
    from fnattn.bench.cases.sparse_mla import sparse_decode_setup, usual_sparse_layer, usual_sparse_layer_translating

    specs, state, b, inputs, _, slots = sparse_decode_setup(batch=5, ctx=700, heads=128, topk=256)
    scale = specs[1].config.mla.scale
    ma = fa.ModelAttention(specs, prefer=("flashmla",), device=DEV, phases=("decode",))
    with ma.session(state, b) as s:
        ours = s.forward(1, inputs)[0].o.float()
    usual = usual_sparse_layer(state, b, inputs, slots, scale)().float()
    translating = usual_sparse_layer_translating(state, b, inputs, inputs.topk_indices, scale)().float()
    rel = float((ours - usual).abs().max() / usual.abs().max())
    ok = torch.equal(usual, translating) and rel <= TOL
    record({"case": "sparse bench rows B5 ctx700 topk256", "o_rel": rel, "usual_rows_equal": ok, "ok": ok})
    assert ok, f"usual rows equal {torch.equal(usual, translating)}, fnattn vs usual {rel:.3e}"


# --------------------------------------------------------------------------- the absorbed query in one launch


@pytest.mark.parametrize("case", ["dense tiny_padded decode", "dense real decode", "dense real verify",
                                  "dense real decode flashinfer", "sparse real decode", "sparse tiny decode",
                                  "sparse real verify", "sparse tiny prefill"])
@pytest.mark.parametrize("kernels", [True, False], ids=["one-launch kernels", "batched forms"])
def test_absorb_kernel_matches_reference(case, kernels, record):
    """`absorb_kernel` and `merge_values_kernel`: the fast paths with the absorbed query, and a decode token's
    own-row merge with ``W_UV``, each from one launch (the defaults), and with the batched products the
    switches bring back, against the references (NaN-filled caches, rows of length 0 and 1)."""
    from fnattn.kinds.mla.latent import absorb_kernel, merge_values_kernel
    from fnattn.kinds.sparse_mla.flashmla import merge_values_kernel as sparse_merge_values_kernel

    kind, shape, phase, *backend = case.split()
    backend = backend[0] if backend else "flashmla"
    k = 2 if phase == "verify" else 0
    tag = " absorb kernel" if kernels else " batched absorb and W_UV"
    with absorb_kernel(kernels), merge_values_kernel(kernels), sparse_merge_values_kernel(kernels):
        if kind == "sparse":
            _sparse_case("v32", shape, phase, k, tag, record)
            return
        cfg = mla_config(**{"tiny_padded": TINY_PADDED, "real": REAL}[shape])
        spec = fa.LayerSpec(0, cfg, torch.bfloat16)
        st = filled_state([spec], CACHED, page_size=64, device=DEV)
        b = _batch(st, phase, list(range(len(CACHED))), k)
        _check(compare([spec], st, b, backend, seed=k), f"mla {shape} {phase} k{k} {backend}{tag}", record)


def test_absorb_kernel_tiny_model_logits(record):
    from fnattn.kinds.mla.latent import absorb_kernel, merge_values_kernel
    from fnattn.kinds.sparse_mla.flashmla import merge_values_kernel as sparse_merge_values_kernel

    model, params = _tiny_model("deepseek_v32", 512)
    specs = params.config.specs
    with absorb_kernel(True), merge_values_kernel(True), sparse_merge_values_kernel(True):
        f, _ = _model_run(model, params, fa.ModelAttention(specs, device=DEV))
    r, _ = _model_run(model, params, fa.ModelAttention(specs, prefer=("reference",), device=DEV))
    err = float((f - r).abs().max() / r.abs().max())
    ok = bool(torch.isfinite(f).all()) and err <= 5e-2
    record({"case": "model deepseek_v32 topk 512 absorb kernel", "logits_rel": err, "ok": ok})
    assert ok, f"rel {err:.3e}"


def test_absorb_kernel_against_the_batched_product(record):
    from fnattn.kernels.latent_absorb import absorb_query

    from fnattn.bench.cases.mla import deepseek_mla, random_inputs
    from fnattn.kinds.mla.latent import absorbed_query_torch

    for T in (1, 64, 200):
        inputs = random_inputs(deepseek_mla(128), T)
        got, want = absorb_query(inputs.q_nope, inputs.q_pe, inputs.w_uk).float(), absorbed_query_torch(inputs).float()
        rel = float((got - want).abs().max() / want.abs().max())
        ok = rel <= 1e-2
        record({"case": f"absorb_query T{T} h128 against bmm", "o_rel": rel, "ok": ok})
        assert ok, f"T {T}: {rel:.3e}"
