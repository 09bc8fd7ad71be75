"""Models made ready once and reused: a cache directory per recipe, written atomically.

Some shipped models need work before they can load fast (a GGUF dequantized into
safetensors, an ONNX graph given seedable noise inputs). That work runs on first use and
its result is kept under :func:`cache_root` (``$OMNIRELAY_CACHE`` or
``~/.cache/omnirelay``), in a directory whose name carries a hash of the recipe (the
source file's size and mtime, the versions that shaped the result), so a new wheel or a
new recipe prepares again instead of loading a stale copy.

* :func:`prepared_dir` — where a recipe's result lives (it may not exist yet).
* :func:`prepare_once` — build it aside with a writer callback, then rename it into place
  (stage processes that start together never see a half-written directory; the loser of
  a race drops its copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirelay.errors import ModelError

__all__ = [
    "CACHE_ENV",
    "DONE_MARKER",
    "cache_root",
    "file_fingerprint",
    "is_prepared",
    "prepare_once",
    "prepared_dir",
]

CACHE_ENV = "OMNIRELAY_CACHE"
#: Written last into a prepared directory: its presence means the directory is complete.
DONE_MARKER = "omnirelay_prepared.json"


def cache_root() -> Path:
    """``$OMNIRELAY_CACHE``, else ``~/.cache/omnirelay``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "omnirelay"


def prepared_dir(name: str, recipe: dict[str, Any]) -> Path:
    """``<cache root>/<name>-<hash of recipe>``."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / f"{name}-{key}"


def is_prepared(target: Path) -> bool:
    return (target / DONE_MARKER).is_file()


def prepare_once(target: Path, write: Callable[[Path], None], recipe: dict[str, Any]) -> Path:
    """``target``, built by ``write(tmp_dir)`` unless it is already complete."""
    if is_prepared(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        raise ModelError(f"cannot create a directory next to {target}: {exc}") from exc
    try:
        write(tmp)
        (tmp / DONE_MARKER).write_text(json.dumps(recipe, indent=1, sort_keys=True, default=str) + "\n")
        try:
            if target.exists() and not is_prepared(target):
                shutil.rmtree(target)  # an interrupted older attempt
            os.rename(tmp, target)
        except OSError:
            if not is_prepared(target):
                raise
            # Another process won the race; its result is the same.
    except OSError as exc:
        raise ModelError(f"cannot write {target}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def file_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies a source file for a recipe without reading it: path, size, mtime."""
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
