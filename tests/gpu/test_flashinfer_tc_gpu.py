"""fnattn's FlashInfer decode on both of FlashInfer's configurations (plain below batch 8, tensor cores from
batch 8 up with GQA >= 4) against the reference, bf16, on a GPU. Set FNATTN_GPU_RESULTS to record."""

import pytest
import torch

import fnattn as fa
from fnattn.kinds.full.flashinfer import use_tensor_cores

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 8, 33])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (8, 2, 256), (8, 8, 128)])
def test_flashinfer_decode_matches_reference_in_each_configuration(batch, hq, hkv, d, record):
    pytest.importorskip("flashinfer")
    spec = fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                        dtype=torch.bfloat16)
    cached = [(37 * r) % 300 + 1 for r in range(batch)]
    st = fa.State([spec], num_pages=sum(-(-(c + 1) // 16) for c in cached) + 1, page_size=16, max_requests=batch,
                  device="cuda", fill=float("nan"))
    for r in range(batch):
        st = st.admit(r)
    st = st.reserve({r: c for r, c in enumerate(cached)})
    gen = torch.Generator(device="cuda").manual_seed(0)

    def inputs(T):
        r = lambda h, dd: torch.randn(T, h, dd, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
        return fa.FullAttentionInputs(q=r(hq, d), k=r(hkv, d), v=r(hkv, d))

    b = fa.Batch.prefill(st, {r: c for r, c in enumerate(cached)})
    with fa.ModelAttention([spec], prefer=("reference",), device="cuda").session(st, b) as s:
        _, w = s.forward(0, inputs(b.num_tokens))
    st = st.apply(fa.StepDeltas.collect(b, [w])).reserve({r: 1 for r in range(batch)})
    b = fa.Batch.decode(st, range(batch))
    report = fa.probe(spec, state=st, batch=b, inputs=inputs(batch), backends=["flashinfer"])
    (row,) = report.rows
    tc = use_tensor_cores(spec.config, batch)
    ok = row.max_rel <= 2e-2
    record({"case": f"flashinfer decode B{batch} {hq}q/{hkv}kv d{d} tensor_cores={tc}", "phase": "decode",
            "backend": "flashinfer", "max_abs": row.max_abs, "max_rel": row.max_rel, "ok": ok})
    assert ok, f"max rel {row.max_rel:.3e}"
