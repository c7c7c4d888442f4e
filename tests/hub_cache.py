"""A Hugging Face hub cache folder written in the hub's own layout, for offline hub-id tests."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub_cache(cache: Path, repo: str, files: dict[str, Path], commit: str = COMMIT,
                       link: bool = False) -> Path:
    """Put `files` (name in the repo → source file) into the cache as the hub does: content-addressed blobs,
    the snapshot of `commit` made of symlinks to them, refs/main naming the commit. link: symlink the blob to
    the source instead of copying it (a large file)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for name, source in files.items():
        blob = root / "blobs" / hashlib.sha256(f"{repo}/{name}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to(source.resolve()) if link else shutil.copyfile(source, blob)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    return snapshot
