"""Loading a local Hugging Face checkpoint directory: config.json plus safetensors.

Tensors are read one at a time, memory-mapped, cast and moved, so the weights
are never held twice. A missing or mis-shaped tensor raises an error naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or tensor, or holds a tensor of the wrong shape."""


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"checkpoint {path}: no config.json")
    raw = _read_json(cfg)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg}: must hold a JSON object, got a {type(raw).__name__}")
    return raw


def _eos_field(file: Path, raw: dict) -> set[int]:
    value = raw.get("eos_token_id")
    if value is None:
        return set()
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CheckpointError(f"{file}: `eos_token_id` must be a token id or a list of token ids, got {value!r}")
    return set(values)


def read_eos_token_ids(path: str | Path) -> frozenset[int]:
    """The eos ids of config.json and generation_config.json together (either may be one id or a list).

    Both are read because chat checkpoints often list their end-of-turn ids only in
    generation_config.json (which transformers prefers) while config.json names the base eos.
    """
    path = Path(path)
    ids = _eos_field(path / "config.json", read_config(path))
    raw = _generation_config(path)
    if raw is not None:
        ids |= _eos_field(path / "generation_config.json", raw)
    return frozenset(ids)


def _generation_config(path: Path) -> dict | None:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return None
    raw = _read_json(gen)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{gen}: must hold a JSON object, got a {type(raw).__name__}")
    return raw


def _is_number(v: object) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> (check, what it must be)
_SAMPLING_FIELDS = {
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
}


def read_sampling_defaults(path: str | Path) -> dict:
    """The sampling fields generation_config.json sets (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``min_p``; null or absent ones left out), checked; ``{}`` without the file."""
    path = Path(path)
    raw = _generation_config(path) or {}
    out = {}
    for name, (ok, what) in _SAMPLING_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if not ok(value):
            raise CheckpointError(f"{path / 'generation_config.json'}: `{name}` must be {what}, got {value!r}")
        out[name] = float(value) if name in ("temperature", "top_p", "min_p") else value
    return out


class CheckpointReader(Mapping):
    """A lazy, read-only mapping name -> tensor over one or several safetensors files.

    Reading a name loads that tensor alone, cast to ``dtype`` on ``device``.
    `expect` checks shapes; `unread` lists what nobody asked for.
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype, device: str | torch.device = "cpu",
                 prefix: str = "", _files: dict | None = None, _read: set | None = None):
        self.path, self.dtype, self.device, self.prefix = Path(path), dtype, torch.device(device), prefix
        self._files = _files if _files is not None else _index(self.path)
        self._read = _read if _read is not None else set()

    def sub(self, prefix: str) -> "CheckpointReader":
        """The same checkpoint seen under ``prefix`` (e.g. "model.layers.3.self_attn.")."""
        return CheckpointReader(self.path, dtype=self.dtype, device=self.device, prefix=self.prefix + prefix,
                                _files=self._files, _read=self._read)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        full = self.prefix + name
        if full not in self._files:
            raise CheckpointError(f"checkpoint {self.path}: tensor {full!r} is missing")
        file = self._files[full]
        try:
            with safe_open(str(file), framework="pt") as f:
                t = f.get_tensor(full)
        except Exception as e:  # safetensors raises its own error types for truncated or foreign files
            raise CheckpointError(f"{file}: tensor {full!r} cannot be read ({_first_line(e)})") from None
        self._read.add(full)
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def expect(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``, checked to be floating point (weights are cast to ``dtype``) of ``shape``."""
        t = self[name]
        if not t.is_floating_point():
            raise CheckpointError(f"checkpoint {self.path}: tensor {self.prefix + name!r} has dtype {t.dtype}, "
                                  f"expected a floating-point dtype")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {self.prefix + name!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}")
        return t

    def __contains__(self, name) -> bool:
        return (self.prefix + name) in self._files

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (k[n:] for k in self._files if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def unread(self) -> list[str]:
        return sorted(set(self._files) - self._read)


def _index(path: Path) -> dict[str, Path]:
    """name -> file, from model.safetensors or model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: `weight_map` must be an object of tensor name -> file name, "
                                  f"got {weight_map!r:.80}")
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path}: shard {f.name} named in the index is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # a truncated file or one that is not safetensors
            raise CheckpointError(f"{single}: not a readable safetensors file ({_first_line(e)})") from None
    raise CheckpointError(f"checkpoint {path}: neither model.safetensors nor model.safetensors.index.json")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else type(e).__name__
