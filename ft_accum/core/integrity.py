"""File integrity: the sha256 used to verify bundled weights and checkpoint manifests."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks so large weights need no extra memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
