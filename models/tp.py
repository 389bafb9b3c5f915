"""Tensor-parallel models: each family's plan for splitting its checkpoint over ``tp`` ranks.

A family's `FamilyTP` says, for every checkpoint tensor, whether it is split
by output rows (column-parallel: the projections into q / k / v / gate heads,
an MLP's gate and up), split by input columns (row-parallel: ``o_proj``,
``out_proj``, ``down_proj``, whose outputs `fnattn.tp.all_reduce` sums),
kept on rank 0 only (the bias of a row-parallel projection, added once) or
replicated (norms, embeddings, routers, MLA's shared latent projections, the
DSA indexer). It also gives the rank's model config: the head counts and
intermediate sizes divided by ``tp`` (key/value heads replicated when there
are fewer than ranks), so the config's layer specs, and the State pools built
from them, hold only the rank's heads. A MoE shards every expert's
intermediate size (each rank runs every routed expert on its slice).

`KindTP` is the same per attention kind: the rank's spec of a full-size spec
and which axis of each storage tensor holds heads. `gather_request` /
`split_request` use it to move a request between TP degrees (prefill with
tp=2, decode with tp=1): the heads of each rank's `RequestState` are put back
together (or cut apart) and the payload is one of the other degree's specs.

The row-parallel outputs are reduced in the families' step functions (one
`all_reduce` per attention block and per MLP); `shard_model` returns a
`Model` whose step runs under its group (`fnattn.tp.active`), so those calls
reduce over it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fnattn import LayerSpec, RequestState
from fnattn.checks import fail
from fnattn.tp import Segment, TPGroup, active, local_units, shard, unshard
from fnattn.transfer import fingerprint, layer_signature, request_state

from .registry import Family, Model, _with_dtype, family_named, random_checkpoint, read_checkpoint

__all__ = ["FAMILY_TP", "KIND_TP", "FamilyTP", "First", "KindTP", "Replicated", "Split", "gather_request",
           "load_model_tp", "random_model_tp", "register_family_tp", "shard_model", "shard_spec", "shard_weights",
           "split_request"]


# --------------------------------------------------------------------------- how one tensor splits


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole tensor."""


@dataclass(frozen=True)
class First:
    """Rank 0 holds the tensor, the others zeros: a row-parallel projection's bias, added once by the sum."""


@dataclass(frozen=True)
class Split:
    """Each rank holds its blocks of every segment along ``dim`` (0: output rows, 1: input columns)."""

    dim: int
    segments: tuple[Segment, ...]


Rule = Replicated | First | Split


def heads(units: int, size: int, field: str, *, replicate: bool = False) -> tuple[Segment, ...]:
    return (Segment(units, size, field, replicate),)


def _apply(rule: Rule, x: Tensor, tp: int, rank: int) -> Tensor:
    if isinstance(rule, Replicated):
        return x
    if isinstance(rule, First):
        return x if rank == 0 else torch.zeros_like(x)
    return shard(x, rule.dim, rule.segments, tp, rank)


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class FamilyTP:
    """``local_config(cfg, tp)``: the rank's model config (ValueError naming the field that does not
    split); ``rules(cfg)``: ``(regex, rule or match -> rule)`` pairs, the first full match per
    checkpoint tensor name wins, and a name none matches is refused (nothing is replicated by default)."""

    local_config: Callable
    rules: Callable


FAMILY_TP: dict[str, FamilyTP] = {}


def register_family_tp(names: Sequence[str], plan: FamilyTP) -> None:
    for name in names:
        if name in FAMILY_TP:
            raise ValueError(f"register_family_tp: family {name!r} already has a TP plan")
        FAMILY_TP[name] = plan


def _split(tp: int, where: str, **fields) -> dict:
    """``{field: value / tp}`` for the named config fields (``(value, True)``: replicated below tp)."""
    out = {}
    for name, value in fields.items():
        value, rep = value if isinstance(value, tuple) else (value, False)
        out[name] = local_units(value, tp, field=name, replicate=rep, where=where) if value else value
    return out


def _mlp_rules(prefix: str, inner: int, field: str, names=("gate_proj", "up_proj", "down_proj")):
    if not inner:  # a config without this MLP (e.g. no shared expert): no tensors to match
        return []
    gate, up, down = (re.escape(n) for n in names)
    seg = heads(inner, 1, field)
    return [(rf"{prefix}(?:{gate}|{up})\.weight", Split(0, seg)), (rf"{prefix}{down}\.weight", Split(1, seg))]


_L = r"model\.layers\.\d+\."
_NORMS = [(r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight", Replicated()),
          (_L + r"(?:input_layernorm|post_attention_layernorm)\.weight", Replicated())]


# Llama / Qwen3 / Qwen2 ---------------------------------------------------------------------------

def _dense_local(cfg, tp):
    return replace(cfg, **_split(tp, f"{cfg.model_type} tp={tp}", num_attention_heads=cfg.num_attention_heads,
                                 num_key_value_heads=(cfg.num_key_value_heads, True),
                                 intermediate_size=cfg.intermediate_size))


def _dense_rules(cfg):
    a, Dh = _L + r"self_attn\.", cfg.head_dim
    q = heads(cfg.num_attention_heads, Dh, "num_attention_heads")
    kv = heads(cfg.num_key_value_heads, Dh, "num_key_value_heads", replicate=True)
    return [*_NORMS, (a + r"q_proj\.(?:weight|bias)", Split(0, q)), (a + r"[kv]_proj\.(?:weight|bias)", Split(0, kv)),
            (a + r"o_proj\.weight", Split(1, q)), (a + r"o_proj\.bias", First()),
            (a + r"[qk]_norm\.weight", Replicated()),
            *_mlp_rules(_L + r"mlp\.", cfg.intermediate_size, "intermediate_size")]


register_family_tp(("llama", "qwen3", "qwen2"), FamilyTP(_dense_local, _dense_rules))


# Qwen3.5 / Qwen3-Next ----------------------------------------------------------------------------

def _qwen_local(cfg, tp):
    return replace(cfg, **_split(
        tp, f"{cfg.model_type} tp={tp}", num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=(cfg.num_key_value_heads, True), linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size))


def _qwen_rules(cfg):
    L = re.escape(cfg.weight_prefix) + r"layers\.\d+\."
    a, g, m = L + r"self_attn\.", L + r"linear_attn\.", L + r"mlp\."
    Dh, K, V = cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    Hk, H = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kh, vh = "linear_num_key_heads", "linear_num_value_heads"
    q = heads(cfg.num_attention_heads, Dh, "num_attention_heads")
    kv = heads(cfg.num_key_value_heads, Dh, "num_key_value_heads", replicate=True)
    conv = (Segment(Hk, K, kh), Segment(Hk, K, kh), Segment(H, V, vh))  # the q | k | v channels
    r = H // Hk
    top = re.escape(cfg.weight_prefix)
    return [
        (rf"{top}embed_tokens\.weight|{top}norm\.weight|lm_head\.weight", Replicated()),
        (L + r"(?:input_layernorm|post_attention_layernorm)\.weight", Replicated()),
        # gated attention: per head, Dh query rows then Dh output-gate rows
        (a + r"q_proj\.weight", Split(0, heads(cfg.num_attention_heads, 2 * Dh, "num_attention_heads"))),
        (a + r"[kv]_proj\.weight", Split(0, kv)), (a + r"o_proj\.weight", Split(1, q)),
        (a + r"[qk]_norm\.weight", Replicated()),
        # Gated DeltaNet, Qwen3.5's split projections
        (g + r"in_proj_qkv\.weight|" + g + r"conv1d\.(?:weight|bias)", Split(0, conv)),
        (g + r"in_proj_z\.weight", Split(0, heads(H, V, vh))),
        (g + r"in_proj_[ab]\.weight|" + g + r"dt_bias|" + g + r"A_log", Split(0, heads(H, 1, vh))),
        # Qwen3-Next's fused ones, grouped per key head: [q K, k K, v rV, z rV] and [b r, a r]
        (g + r"in_proj_qkvz\.weight", Split(0, heads(Hk, 2 * K + 2 * r * V, kh))),
        (g + r"in_proj_ba\.weight", Split(0, heads(Hk, 2 * r, kh))),
        (g + r"norm\.weight", Replicated()), (g + r"out_proj\.weight", Split(1, heads(H, V, vh))),
        (m + r"gate\.weight|" + m + r"shared_expert_gate\.weight", Replicated()),
        *_mlp_rules(m + r"experts\.\d+\.", cfg.moe_intermediate_size, "moe_intermediate_size"),
        *_mlp_rules(m + r"shared_expert\.", cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size"),
        *_mlp_rules(m, cfg.intermediate_size, "intermediate_size"),
    ]


register_family_tp(("qwen3_5", "qwen3_next"), FamilyTP(_qwen_local, _qwen_rules))


# DeepSeek-V3 / V3.2 / GLM-5 and Kimi Linear's MLA ------------------------------------------------

def _mla_rules(a: str, cfg):
    """MLA: the per-head q (``q_proj`` / ``q_b_proj``) and ``kv_b_proj`` rows split, ``o_proj`` by
    columns; the latent path (``q_a``, ``kv_a``, their norms) replicated: every rank caches the latent."""
    H, Dn, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    return [(a + r"q_(?:b_)?proj\.weight", Split(0, heads(H, Dn + cfg.qk_rope_head_dim, "num_heads"))),
            (a + r"(?:q_a_proj|kv_a_proj_with_mqa)\.(?:weight|bias)|" + a + r"(?:q_a|kv_a)_layernorm\.weight",
             Replicated()),
            (a + r"kv_b_proj\.weight", Split(0, heads(H, Dn + Dv, "num_heads"))),
            (a + r"o_proj\.weight", Split(1, heads(H, Dv, "num_heads"))), (a + r"o_proj\.bias", First())]


def _deepseek_local(cfg, tp):
    where = f"{cfg.model_type} tp={tp}"
    moe = cfg.moe and replace(cfg.moe, **_split(tp, where, moe_intermediate_size=cfg.moe.moe_intermediate_size))
    return replace(cfg, moe=moe, **_split(tp, where, num_heads=cfg.num_heads,
                                          intermediate_size=cfg.intermediate_size))


def _deepseek_rules(cfg):
    a, m = _L + r"self_attn\.", _L + r"mlp\."
    rules = [*_NORMS, (a + r"indexer\..+", Replicated()), *_mla_rules(a, cfg),
             (m + r"gate\.(?:weight|e_score_correction_bias)", Replicated()),
             *_mlp_rules(m, cfg.intermediate_size, "intermediate_size")]
    if cfg.moe is not None:
        inner = cfg.moe.moe_intermediate_size
        rules += [*_mlp_rules(m + r"experts\.\d+\.", inner, "moe_intermediate_size"),
                  *_mlp_rules(m + r"shared_experts\.", inner * cfg.moe.n_shared_experts, "moe_intermediate_size")]
    return rules


register_family_tp(("deepseek_v3", "deepseek_v32", "glm5"), FamilyTP(_deepseek_local, _deepseek_rules))


def _kimi_local(cfg, tp):
    return replace(cfg, **_split(tp, f"kimi_linear tp={tp}", kda_heads=cfg.kda_heads, num_heads=cfg.num_heads,
                                 intermediate_size=cfg.intermediate_size,
                                 moe_intermediate_size=cfg.moe_intermediate_size))


def _kimi_rules(cfg):
    a, b = r"model\.layers\.(\d+)\.self_attn\.", _L + r"block_sparse_moe\."
    H, K = cfg.kda_heads, cfg.kda_head_dim
    hk, h1 = heads(H, K, "kda_heads"), heads(H, 1, "kda_heads")
    mla = {pat: rule for pat, rule in _mla_rules(a, cfg)}

    def by_layer(kda_rule: Rule, mla_pattern: str | None):
        """q_proj and o_proj exist in both layer types, with other shapes: the layer decides."""
        def rule(match: re.Match) -> Rule:
            if cfg.layer_types[int(match.group(1))] == "linear_attention":
                return kda_rule
            return mla[mla_pattern] if mla_pattern else Replicated()
        return rule

    q_mla = next(p for p in mla if "q_(?:b_)?proj" in p)
    o_mla = next(p for p in mla if p.endswith(r"o_proj\.weight"))
    inner = cfg.moe_intermediate_size
    return [*_NORMS,
            (a + r"q_proj\.weight", by_layer(Split(0, hk), q_mla)),
            (a + r"o_proj\.weight", by_layer(Split(1, hk), o_mla)),
            *mla.items(),
            (a + r"(?:[kv]_proj|[qkv]_conv1d|f_b_proj|g_b_proj)\.weight|" + a + r"dt_bias", Split(0, hk)),
            (a + r"A_log", Split(2, h1)), (a + r"b_proj\.weight", Split(0, h1)),
            (a + r"(?:f_a_proj|g_a_proj|o_norm)\.weight", Replicated()),
            (b + r"gate\.(?:weight|e_score_correction_bias)", Replicated()),
            *_mlp_rules(b + r"experts\.\d+\.", inner, "moe_intermediate_size", names=("w1", "w3", "w2")),
            *_mlp_rules(b + r"shared_experts\.", inner * cfg.n_shared_experts, "moe_intermediate_size"),
            *_mlp_rules(_L + re.escape(cfg.dense_mlp_name) + r"\.", cfg.intermediate_size, "intermediate_size")]


register_family_tp(("kimi_linear",), FamilyTP(_kimi_local, _kimi_rules))


# DeepSeek-V4 ---------------------------------------------------------------------------------------

def _v4_local(cfg, tp):
    return replace(cfg, **_split(tp, f"deepseek_v4 tp={tp}", num_heads=cfg.num_heads, o_groups=cfg.o_groups,
                                 moe_intermediate_size=cfg.moe_intermediate_size))


def _v4_rules(cfg):
    """Query heads (and their sinks) split; the one shared K=V head, the compressors and the indexer
    replicated; the grouped output projection split by groups of heads (``wo_a`` rows, ``wo_b``
    columns: row-parallel); the mHC mixers replicated; every expert and the shared one by its
    intermediate size."""
    a, f = _L + r"attn\.", _L + r"ffn\."
    H, G = cfg.num_heads, cfg.o_groups
    groups = heads(G, cfg.o_lora_rank, "o_groups")
    return [(r"model\.embed_tokens\.weight|model\.norm\.weight|head\.weight|model\.hc_head\.hc_(?:fn|base|scale)",
             Replicated()),
            (_L + r"(?:attn_norm|ffn_norm)\.weight|" + _L + r"hc_(?:attn|ffn)_(?:fn|base|scale)", Replicated()),
            (a + r"attn_sink", Split(0, heads(H, 1, "num_heads"))),
            (a + r"wq_b\.weight", Split(0, heads(H, cfg.head_dim, "num_heads"))),
            (a + r"(?:wq_a|q_norm|wkv|norm)\.weight|" + a + r"(?:compressor|indexer)\..+", Replicated()),
            (a + r"wo_a\.weight", Split(0, groups)), (a + r"wo_b\.weight", Split(1, groups)),
            (f + r"gate\.(?:weight|bias|tid2eid)", Replicated()),
            *_mlp_rules(f + r"experts\.\d+\.", cfg.moe_intermediate_size, "moe_intermediate_size",
                        names=("w1", "w3", "w2")),
            *_mlp_rules(f + r"shared_experts\.", cfg.moe_intermediate_size, "moe_intermediate_size",
                        names=("w1", "w3", "w2"))]


register_family_tp(("deepseek_v4",), FamilyTP(_v4_local, _v4_rules))


# --------------------------------------------------------------------------- attention kinds


@dataclass(frozen=True)
class KindTP:
    """``shard(config, tp)``: the rank's config; ``layout(config, name)``: ``(axis, segments)`` of storage
    tensor ``name`` in a `RequestState` (per-token tensors have the token axis first), None: replicated."""

    shard: Callable
    layout: Callable


def _full_layout(c, name):
    return 1, heads(c.num_kv_heads, 1, "num_kv_heads", replicate=True)


def _recurrent_layout(c, name):
    if name == "ssm":  # [H, K, V]
        return 0, heads(c.num_state_heads, 1, "num_state_heads")
    Hk = c.num_qk_heads  # conv window [q | k | v channels, W - 1]
    return 0, (Segment(Hk, c.head_k_dim, "num_qk_heads"), Segment(Hk, c.head_k_dim, "num_qk_heads"),
               Segment(c.num_state_heads, c.head_v_dim, "num_state_heads"))


def _by(tp, c, **fields):
    return replace(c, **{k: local_units(v[0] if isinstance(v, tuple) else v, tp, field=k,
                                        replicate=isinstance(v, tuple), where=f"{type(c).__name__} tp={tp}")
                         for k, v in fields.items()})


KIND_TP: dict[str, KindTP] = {
    "full": KindTP(lambda c, tp: _by(tp, c, num_q_heads=c.num_q_heads, num_kv_heads=(c.num_kv_heads,)),
                   _full_layout),
    "mla": KindTP(lambda c, tp: _by(tp, c, num_heads=c.num_heads), lambda c, name: None),
    "sparse_mla": KindTP(lambda c, tp: replace(c, mla=_by(tp, c.mla, num_heads=c.mla.num_heads)),
                         lambda c, name: None),  # latent and indexer keys: replicated
    "gdn": KindTP(lambda c, tp: _by(tp, c, num_k_heads=c.num_k_heads, num_v_heads=c.num_v_heads), _recurrent_layout),
    "kda": KindTP(lambda c, tp: _by(tp, c, num_heads=c.num_heads), _recurrent_layout),
    # one K=V head, compressed entries and index keys: every head's, replicated
    "dsv4": KindTP(lambda c, tp: _by(tp, c, num_heads=c.num_heads), lambda c, name: None),
}


def _kind_tp(spec: LayerSpec) -> KindTP:
    if spec.kind not in KIND_TP:
        fail("tp", f"layer {spec.index} kind", f"one with a TP plan ({sorted(KIND_TP)})", spec.kind)
    return KIND_TP[spec.kind]


def shard_spec(spec: LayerSpec, tp: int) -> LayerSpec:
    """The spec one of ``tp`` ranks runs for ``spec``: its heads divided (KV heads replicated below tp)."""
    return spec if tp == 1 else replace(spec, config=_kind_tp(spec).shard(spec.config, tp))


# --------------------------------------------------------------------------- models


def _family_tp(name: str) -> FamilyTP:
    if name not in FAMILY_TP:
        fail("tp", "family", f"one with a TP plan ({sorted(FAMILY_TP)})", name)
    return FAMILY_TP[name]


def shard_weights(family: Family, cfg, weights: Mapping[str, Tensor], tp: int, rank: int):
    """``-> (the rank's config, {checkpoint name: the rank's tensor})``, checked against the family's
    `weight_shapes` of the rank's config (so the plan and the config cannot disagree)."""
    plan = _family_tp(family.name)
    local = plan.local_config(cfg, tp)
    rules = [(re.compile(p), r) for p, r in plan.rules(cfg)]
    want = dict(family.weight_shapes(local))
    want.update({k: shape for k, (shape, _) in (family.index_shapes(local) if family.index_shapes else {}).items()})
    where = f"{family.name} tp={tp}"
    if set(weights) != set(want):
        fail(where, "weights", f"the tensors of the config ({len(want)})", sorted(set(weights) ^ set(want))[:5])
    out = {}
    for name, x in weights.items():
        match, rule = next(((m, r) for p, r in rules if (m := p.fullmatch(name))), (None, None))
        if match is None:
            fail(where, name, "a tensor named by the family's TP plan", "no rule")
        rule = rule(match) if callable(rule) else rule
        out[name] = _apply(rule, x, tp, rank)
        if tuple(out[name].shape) != tuple(want[name]):
            fail(where, name, f"shape {tuple(want[name])} on rank {rank} (the rank's config)", tuple(out[name].shape))
    expect = tuple(shard_spec(s, tp) for s in cfg.specs)
    if tuple(local.specs) != expect:
        bad = next(i for i, (a, b) in enumerate(zip(local.specs, expect)) if a != b)
        fail(where, f"layer {bad} spec", f"the kind's TP shard {expect[bad]}", local.specs[bad])
    return local, out


def _under(group: TPGroup, fn: Callable | None) -> Callable | None:
    if fn is None:
        return None

    def step(*args, **kw):
        with active(group):
            return fn(*args, **kw)

    step.__name__ = getattr(fn, "__name__", "step")
    step.__doc__ = fn.__doc__
    return step


def shard_model(family: Family, cfg, weights: Mapping[str, Tensor], group: TPGroup, *, device=None) -> Model:
    """The rank's `Model`: its weights, its config (specs of its heads) and a step that reduces over
    ``group``. ``weights`` are the whole checkpoint's tensors by name (on any device; the rank's slices
    are copied to ``device``). MTP drafts are not sharded (the model has no ``draft``)."""
    if not isinstance(group, TPGroup):
        fail("shard_model", "group", "a fnattn.tp.TPGroup", type(group).__name__)
    local, mine = shard_weights(family, cfg, weights, group.size, group.rank)
    if device is not None:
        mine = {k: v.to(device) for k, v in mine.items()}
    fam = dataclasses.replace(family, step=_under(group, family.step), step_hidden=_under(group, family.step_hidden),
                              draft=None)
    return Model(fam, local, family.load(local, mine))


def random_model_tp(name: str, group: TPGroup, *, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
                    config: dict | None = None) -> Model:
    """The rank's part of `random_model(name, seed=...)`: the same weights, sharded over ``group``."""
    fam = family_named(name)
    cfg = _with_dtype(fam.adapt(config or fam.tiny_config()), dtype)
    return shard_model(fam, cfg, random_checkpoint(fam, cfg, seed=seed, dtype=dtype), group, device=device)


class _Lazy(Mapping):
    """name -> tensor, read when asked: sharding holds one whole checkpoint tensor in memory at a time."""

    def __init__(self, readers: dict[str, Callable[[], Tensor]]):
        self._readers = readers

    def __getitem__(self, name: str) -> Tensor:
        return self._readers[name]()

    def __iter__(self):
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def load_model_tp(path, group: TPGroup, *, dtype: torch.dtype = torch.float32, device="cpu") -> Model:
    """The rank's part of `load_model(path)`: each tensor is read whole on the CPU, sliced, and dropped."""
    from .loading import CheckpointReader, read_config
    from .registry import family_for

    raw = read_config(path)
    fam = family_for(raw)
    cfg = _with_dtype(fam.adapt(raw), dtype)
    reader = CheckpointReader(path, dtype=dtype, device="cpu")
    readers = {name: functools.partial(reader.expect, name, shape) for name, shape in fam.weight_shapes(cfg).items()}
    # the integer routing tables (small), read and range-checked as load_model reads them
    tables = read_checkpoint(path, dataclasses.replace(fam, weight_shapes=lambda _: {}), cfg, dtype=dtype)
    readers.update({name: (lambda t=t: t) for name, t in tables.items()})
    return shard_model(fam, cfg, _Lazy(readers), group, device=device)


# --------------------------------------------------------------------------- requests between TP degrees


def gather_request(parts: Sequence[RequestState], specs: Sequence[LayerSpec]) -> RequestState:
    """One request of the whole model (``specs``) from its ``tp = len(parts)`` ranks' payloads, in rank order.

    Each part must be a payload of the rank specs `shard_spec` gives (fingerprint checked); replicated
    storage must be equal on every rank. The result imports into a State of ``specs``."""
    where = "gather_request"
    tp = len(parts)
    if tp < 1 or not all(isinstance(p, RequestState) for p in parts):
        fail(where, "parts", "one RequestState per rank, in rank order", [type(p).__name__ for p in parts])
    local = tuple(shard_spec(s, tp) for s in specs)
    want = fingerprint([layer_signature(s) for s in local])
    for r, p in enumerate(parts):
        p.verify(where)
        if p.fingerprint != want:
            fail(where, f"parts[{r}]", f"a payload of the tp={tp} rank specs (fingerprint {want[:16]}...)",
                 f"fingerprint {p.fingerprint[:16]}...")
        if (p.request_id, p.length) != (parts[0].request_id, parts[0].length):
            fail(where, f"parts[{r}]", f"request {parts[0].request_id} of length {parts[0].length} (rank 0's)",
                 f"request {p.request_id} of length {p.length}")
    tensors = {}
    for spec in specs:
        for d in spec.config.storage(spec.dtype):
            key = (spec.index, d.name)
            pieces = [p.tensors[key] for p in parts]
            layout = _kind_tp(spec).layout(spec.config, d.name)
            if layout is None:
                for r, x in enumerate(pieces):
                    if not torch.equal(x, pieces[0]):
                        fail(where, f"parts[{r}].tensors[{key}]", "rank 0's replicated rows", "different values")
                tensors[key] = pieces[0]
            else:
                tensors[key] = unshard(pieces, layout[0], layout[1])
    return request_state(specs, parts[0].request_id, parts[0].length, tensors)


def split_request(payload: RequestState, specs: Sequence[LayerSpec], tp: int, rank: int) -> RequestState:
    """Rank ``rank``'s part of a payload of the whole model (``specs``), for a State of the tp rank specs."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        fail("split_request", "tp", "a positive int", tp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        fail("split_request", "rank", f"an int in [0, {tp})", rank)
    payload.verify("split_request")
    full = fingerprint([layer_signature(s) for s in specs])
    if payload.fingerprint != full:
        fail("split_request", "payload", f"a payload of the whole model's specs (fingerprint {full[:16]}...)",
             f"fingerprint {payload.fingerprint[:16]}...")
    local = tuple(shard_spec(s, tp) for s in specs)
    tensors = {}
    for spec in specs:
        for d in spec.config.storage(spec.dtype):
            key = (spec.index, d.name)
            layout = _kind_tp(spec).layout(spec.config, d.name)
            x = payload.tensors[key]
            tensors[key] = x if layout is None else shard(x, layout[0], layout[1], tp, rank)
    return request_state(local, payload.request_id, payload.length, tensors)
