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


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"checkpoint {path}: no config.json")
    return json.loads(cfg.read_text())


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
        with safe_open(str(self._files[full]), framework="pt") as f:
            t = f.get_tensor(full)
        self._read.add(full)
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def expect(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self[name]
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
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path}: shard {f.name} named in the index is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"checkpoint {path}: neither model.safetensors nor model.safetensors.index.json")
