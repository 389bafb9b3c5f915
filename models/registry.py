"""Model families: each turns a Hugging Face config dict into specs and a step function.

A family module registers one `Family`. Loading is generic: the family lists
every tensor it reads with its shape (`weight_shapes`), the checkpoint reader
checks and loads each once, and `load` arranges them into the family's params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .loading import CheckpointError, CheckpointReader, read_config


@dataclass(frozen=True)
class Family:
    name: str  # short name, e.g. "qwen3_5"
    model_types: tuple[str, ...]  # the config.json `model_type` values it reads
    adapt: Callable[[dict], Any]  # config dict -> frozen model config (with `.specs` and `.vocab_size`)
    weight_shapes: Callable[[Any], dict[str, tuple[int, ...]]]  # every tensor read, by checkpoint name
    load: Callable[[Any, Any], Any]  # (model config, mapping name -> tensor) -> params
    step: Callable  # (params, session, tokens [T]) -> (logits [T, vocab], StepDeltas)
    tiny_config: Callable[[], dict]  # a small config.json dict for demos and tests
    # (params, session, tokens [T]) -> (logits [T, vocab], hidden [T, D] (the final norm's output), StepDeltas)
    step_hidden: Callable | None = None
    # (model config, params, weights mapping | None, *, seed) -> models.mtp.DraftModel (random when no weights)
    draft: Callable | None = None
    # model config -> the lanes built inside a captured step (e.g. an indexer's top-k): `fnattn.lanes.Lane`s
    generated_lanes: Callable[[Any], tuple] | None = None

    def manifest(self, cfg, *, hidden: bool = False):
        """The lanes of this family's captured step (`fnattn.lanes`): the tokens and the batch's tensors in,
        the fp32 logits out (and the final norm's ``hidden`` output, for `step_hidden`), and what the step
        generates on the device."""
        from fnattn.lanes import step_manifest

        if hidden and self.step_hidden is None:
            raise ValueError(f"family {self.name!r}: `hidden` needs a step_hidden, which this family has not")
        generated = tuple(self.generated_lanes(cfg)) if self.generated_lanes is not None else ()
        return step_manifest(vocab=cfg.vocab_size, hidden=cfg.hidden_size if hidden else None,
                             hidden_dtype=cfg.dtype, generated=generated)
    # model config -> {checkpoint name: (shape, bound)}: integer tensors read as they are, values in 0..bound-1
    # (routing tables)
    index_shapes: Callable | None = None


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"register_family: family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    import importlib

    # Each draft module builds on its target family's module and registers its builder there: families first.
    for module in ("qwen3_5", "qwen3_next", "deepseek_v32", "glm5", "kimi_linear", "llama", "deepseek_v4",
                   "qwen3_5_mtp", "deepseek_mtp", "deepseek_v4_mtp"):
        try:
            importlib.import_module(f"{__package__}.{module}")
        except ModuleNotFoundError as e:  # a family or draft not shipped in this build
            if e.name != f"{__package__}.{module}":
                raise


def family_for(config: dict) -> Family:
    _load_builtin()
    model_type = config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"config.json: `model_type` must be one of {known}, got {model_type!r}")


def family_named(name: str) -> Family:
    _load_builtin()
    if name not in FAMILIES:
        raise ValueError(f"model family must be one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_names() -> list[str]:
    """Every registered family's name, sorted."""
    _load_builtin()
    return sorted(FAMILIES)


@dataclass(frozen=True)
class Model:
    family: Family
    config: Any
    params: Any

    @property
    def specs(self):
        return self.config.specs

    def step(self, params, session, tokens):
        return self.family.step(params, session, tokens)

    def manifest(self, *, hidden: bool = False):
        return self.family.manifest(self.config, hidden=hidden)


def _with_dtype(cfg, dtype: torch.dtype):
    """The model config with its layers in ``dtype`` (the dtype the weights are loaded in)."""
    cfg = dataclasses.replace(cfg, dtype=dtype)
    wrong = [s.index for s in cfg.specs if s.dtype != dtype]
    if wrong:
        raise ValueError(f"model config: layers {wrong} did not take dtype {dtype}")
    return cfg


def load_model(path, *, dtype: torch.dtype = torch.float32, device="cpu") -> Model:
    """Read config.json and the safetensors of a local checkpoint directory."""
    raw = read_config(path)
    fam = family_for(raw)
    cfg = _with_dtype(fam.adapt(raw), dtype)
    return Model(fam, cfg, fam.load(cfg, read_checkpoint(path, fam, cfg, dtype=dtype, device=device)))


def read_checkpoint(path, fam: Family, cfg, *, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor ``fam`` reads for ``cfg`` from a checkpoint directory, by name, shapes checked."""
    reader = CheckpointReader(path, dtype=dtype, device=device)
    weights = {name: reader.expect(name, shape) for name, shape in fam.weight_shapes(cfg).items()}
    for name, (shape, bound) in (fam.index_shapes(cfg) if fam.index_shapes else {}).items():
        t = reader[name]
        if t.is_floating_point() or tuple(t.shape) != tuple(shape) or (t.numel() and not 0 <= int(t.min())
                                                                          <= int(t.max()) < bound):
            raise CheckpointError(f"checkpoint {path}: tensor {name!r} must hold integers in 0..{bound - 1} of "
                                  f"shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
        weights[name] = t
    return weights


def random_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
                 config: dict | None = None) -> Model:
    """A family's tiny config with random weights (scaled so activations stay O(1))."""
    fam = family_named(name)
    cfg = _with_dtype(fam.adapt(config or fam.tiny_config()), dtype)
    return Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg, seed=seed, dtype=dtype, device=device)))


def random_checkpoint(fam: Family, cfg, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device="cpu") -> dict[str, torch.Tensor]:
    """`random_model`'s tensors by checkpoint name: `random_weights`, then the integer tables in range."""
    weights = random_weights(fam.weight_shapes(cfg), seed=seed, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    for name, (shape, bound) in (fam.index_shapes(cfg) if fam.index_shapes else {}).items():
        weights[name] = torch.randint(0, bound, shape, generator=g).to(device)
    return weights


def random_weights(shapes: dict[str, tuple[int, ...]], *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device="cpu") -> dict[str, torch.Tensor]:
    """Seeded normal tensors in ``shapes`` order: matrices scaled by fan-in^-1/2, vectors by 0.1."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for wname, shape in shapes.items():
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.1
        weights[wname] = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    return weights
