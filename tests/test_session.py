import pytest
import torch
from helpers import full_inputs, full_spec, nan_state, registry_scope

import fnattn as fa
from fnattn.kinds.full.reference import paged_attention
from fnattn.workspace import Workspace


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():  # the backends registered here would rank first in later tests
        yield


def setup(n=3):
    spec = full_spec(0)
    st = nan_state([spec]).admit(0)
    st = st.reserve({0: n})
    return spec, st, fa.Batch.prefill(st, {0: n}), fa.ModelAttention([spec])


def test_forward_after_exit_raises():
    spec, st, batch, ma = setup()
    with ma.session(st, batch) as s:
        s.forward(0, full_inputs(spec, 3))
    with pytest.raises(fa.SessionClosedError):
        s.forward(0, full_inputs(spec, 3))
    with pytest.raises(fa.SessionClosedError):
        s.__enter__()


def test_session_rejects_a_batch_of_another_version_and_bad_inputs():
    spec, st, batch, ma = setup()
    st2 = st.admit(1)
    with pytest.raises(ValueError, match="`batch`"):
        with ma.session(st2, batch):
            pass
    batch2 = fa.Batch.prefill(st2, {0: 3})
    with ma.session(st2, batch2) as s:
        good = full_inputs(spec, 3)
        with pytest.raises(ValueError, match="`q`.*shape"):
            s.forward(0, fa.FullAttentionInputs(q=good.q[:2], k=good.k, v=good.v))
        with pytest.raises(ValueError, match="`k`.*dtype"):
            s.forward(0, fa.FullAttentionInputs(q=good.q, k=good.k.double(), v=good.v))
        with pytest.raises(ValueError, match="`sinks`"):
            s.forward(0, fa.FullAttentionInputs(q=good.q, k=good.k, v=good.v, sinks=torch.zeros(4)))
        with pytest.raises(ValueError, match="`layer`"):
            s.forward(5, good)


class RecordingSync:
    """Stands in for device events: logs what is recorded and waited on."""

    def __init__(self):
        self.log = []
        self.n = 0

    def record(self):
        self.n += 1
        self.log.append(("record", self.n))
        return self.n

    def wait(self, marker):
        self.log.append(("wait", marker))


def test_lease_orders_completion_and_rejects_misuse():
    sync = RecordingSync()
    ws = Workspace(torch.device("cpu"), sync=sync)
    a = ws.lease()
    assert a.buffer(64).numel() == 64
    with pytest.raises(fa.LeaseError, match="never released"):
        ws.lease()
    a.release()
    with pytest.raises(fa.LeaseError, match="released twice"):
        a.release()
    with pytest.raises(fa.LeaseError, match="already released"):
        a.buffer(8)
    b = ws.lease()
    # The second lease begins by waiting on the completion marker of the first.
    assert sync.log == [("record", 1), ("wait", 1)]
    b.release()
    ws.lease().release()
    assert sync.log[-2:] == [("wait", 2), ("record", 3)]


def test_session_holds_one_lease_for_its_lifetime():
    spec, st, batch, ma = setup()
    s = ma.session(st, batch).__enter__()
    with pytest.raises(fa.LeaseError, match="never released"):
        ma.session(st, batch).__enter__()
    s.__exit__(None, None, None)
    with ma.session(st, batch):
        pass


def test_explain_lists_refused_backends_with_reasons():
    spec = full_spec(0)

    def needs_gpu(spec, device):
        return [] if device.type == "cuda" else [f"needs a CUDA device, got {device.type}"]

    @fa.register("full", "decode", "test_fast", supports=needs_gpu)
    def fast(spec, views, inputs):  # pragma: no cover - never chosen on CPU
        raise AssertionError

    ma = fa.ModelAttention([spec], prefer=("test_fast", "reference"))
    table = ma.explain()
    assert "test_fast (needs a CUDA device, got cpu)" in table
    assert ma.backend(0, "decode").name == "reference"
    only_fast = fa.ModelAttention([spec], prefer=("test_fast",))
    with pytest.raises(fa.NoBackendError, match="needs a CUDA device"):
        only_fast.backend(0, "decode")


def test_layers_with_one_config_share_a_group_and_a_plan():
    planned = []

    def plan(specs, batch, lease):
        planned.append(tuple(s.index for s in specs))
        return {"layers": len(specs)}

    @fa.register("full", "verify", "test_planned", plan=plan)
    def planned_backend(spec, views, inputs):
        assert inputs.meta.plan == {"layers": 3}
        return paged_attention(spec, views, inputs)

    specs = [full_spec(i) for i in range(3)]
    st = nan_state(specs).admit(0)
    st = st.reserve({0: 3})
    batch = fa.Batch.verify(st, [0], num_draft=2)
    ma = fa.ModelAttention(specs, prefer=("test_planned",))
    with ma.session(st, batch) as s:
        for i in range(3):
            s.forward(i, full_inputs(specs[i], 3))
    assert planned == [(0, 1, 2)]


def test_probe_compares_outputs_not_only_deltas():
    @fa.register("full", "decode", "test_off_by_one")
    def off_by_one(spec, views, inputs):
        out, writes = paged_attention(spec, views, inputs)
        return fa.AttentionOutput(o=out.o + 1.0, lse=out.lse), writes

    spec = full_spec(0)
    st = nan_state([spec]).admit(0)
    st = st.reserve({0: 1})
    report = fa.probe(spec, state=st, batch=fa.Batch.decode(st, [0]), inputs=full_inputs(spec, 1),
                      backends=["reference", "test_off_by_one"])
    errors = {r.backend: r.max_abs for r in report.rows}
    assert errors["reference"] == 0.0 and errors["test_off_by_one"] == pytest.approx(1.0, abs=1e-6)


def test_inputs_of_another_kind_are_refused_by_name():
    spec, st, batch, ma = setup()
    wrong = fa.RecurrentInputs(x=torch.zeros(3, 4), conv_weight=torch.zeros(4, 4), g=torch.zeros(3, 2),
                               beta=torch.zeros(3, 2))
    with ma.session(st, batch) as s:
        with pytest.raises(ValueError, match="`inputs` must be FullAttentionInputs"):
            s.forward(0, wrong)


def test_a_state_of_other_specs_is_refused_after_one_that_matched():
    """The session compares the State's specs with its ModelAttention's once per storage: a second State,
    built for another layer config, is still compared (and refused, naming the layer)."""
    spec, st, batch, ma = setup()
    with ma.session(st, batch):
        pass
    st = st.reserve({0: 1})  # a successor handle of the same storage: no second comparison needed
    with ma.session(st, fa.Batch.decode(st, [0])):
        pass
    st2 = nan_state([full_spec(0, hkv=1)]).admit(0).reserve({0: 3})  # one kv head, not two
    with pytest.raises(ValueError, match="storage for layer 0"):
        with ma.session(st2, fa.Batch.prefill(st2, {0: 3})):
            pass
