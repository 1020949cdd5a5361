"""An on-disk cache of the target's last-layer hidden states, so that epochs after the
first do not run the (frozen) target again.

Layout of the cache folder:
    manifest.json                    what the states belong to (target signature and dtype,
                                     data fingerprint, seq_len); a different run is refused
    rank{r}-{n}.safetensors          shards written by process r: one tensor per example,
                                     named by the example's key, shape (T_example, d), in
                                     the target's dtype (bitwise what the target computed)

Each process buffers the states it computed and writes a shard when the buffer passes
``shard_bytes`` and at every ``flush`` (checkpoints, epoch ends), through a temporary
file and a rename, so a crash never leaves a half-written shard. ``refresh`` rescans the
folder so states written by other processes become visible. Size: tokens x d x bytes per
value (SmolLM2, d = 576, float32: 2.3 kB per token).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import SpecdraftError

MANIFEST = "manifest.json"


class HiddenCache:
    def __init__(self, folder: str | Path, manifest: dict, rank: int = 0, shard_bytes: int = 256 << 20):
        self.folder = Path(folder)
        self.manifest = manifest
        self.rank = rank
        self.shard_bytes = shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        self.hits = self.misses = 0
        self.check_manifest()
        self.refresh()

    # ---- setup ----------------------------------------------------------------------

    @staticmethod
    def create(folder: str | Path, manifest: dict) -> None:
        """Make the folder and write the manifest if there is none (main process only)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / MANIFEST
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
            os.replace(tmp, path)

    def check_manifest(self) -> None:
        path = self.folder / MANIFEST
        if not path.is_file():
            raise SpecdraftError(f"hidden-state cache {self.folder} has no {MANIFEST}")
        found = json.loads(path.read_text())
        if found != json.loads(json.dumps(self.manifest)):
            diff = sorted(k for k in set(found) | set(self.manifest) if found.get(k) != self.manifest.get(k))
            raise SpecdraftError(f"hidden-state cache {self.folder} was made for another run (differs in "
                                 f"{', '.join(diff)}); use another --hidden-cache folder or delete it")

    def refresh(self) -> None:
        """Index every shard in the folder (those of other processes included)."""
        from safetensors import safe_open

        for path in sorted(self.folder.glob("rank*.safetensors")):
            if path in self._open:
                continue
            handle = safe_open(str(path), framework="pt")
            self._open[path] = handle
            for key in handle.keys():
                self._where.setdefault(key, path)

    # ---- use ------------------------------------------------------------------------

    def get(self, key: str, device) -> torch.Tensor | None:
        """The cached (T, d) states of an example, or None."""
        if key in self._buffer:
            self.hits += 1
            return self._buffer[key].to(device)
        path = self._where.get(key)
        if path is None:
            self.misses += 1
            return None
        self.hits += 1
        return self._open[path].get_tensor(key).to(device)

    def put(self, key: str, hidden: torch.Tensor) -> None:
        if key in self._where or key in self._buffer:
            return
        self._buffer[key] = hidden.detach().to("cpu", copy=True).contiguous()
        self._buffered += hidden.numel() * hidden.element_size()
        if self._buffered >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered states as one new shard of this process."""
        from safetensors.torch import save_file

        if not self._buffer:
            return
        n = len(list(self.folder.glob(f"rank{self.rank:03d}-*.safetensors")))
        path = self.folder / f"rank{self.rank:03d}-{n:06d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(self._buffer, str(tmp))
        os.replace(tmp, path)
        self._buffer, self._buffered = {}, 0
        self.refresh()
