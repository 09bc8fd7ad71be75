"""The prepared-model cache: keyed by the source file's content, so two installs of one
wheel (another path, another mtime) share one prepared model, and the digest of an
unchanged file is read from its remembered entry instead of hashing the file again."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from omnirelay.models import prepared
from omnirelay.models.prepared import (
    CACHE_ENV,
    DIGESTS_DIR,
    file_digest,
    file_fingerprint,
    is_prepared,
    prepare_once,
    prepared_dir,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files whose bytes were hashed, in order."""
    calls: list[Path] = []
    real = prepared._sha256_of

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(prepared, "_sha256_of", counting)
    return calls


def _install(root: Path, data: bytes, mtime_ns: int) -> Path:
    """One install of a wheel's data file at ``root`` with its own mtime."""
    path = root / "site-packages" / "llm_pkg" / "model.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def _recipe(path: Path) -> dict[str, object]:
    return {"source": file_fingerprint(path), "recipe": 1}


def test_two_installs_of_one_file_share_one_prepared_model(
    tmp_path: Path, cache: Path, hashed: list[Path]
) -> None:
    data = os.urandom(3 << 20) + b"weights"
    first = _install(tmp_path / "venv-a", data, 1_600_000_000_000_000_000)
    second = _install(tmp_path / "venv-b", data, 1_700_000_000_123_456_789)
    assert (
        file_fingerprint(first)
        == file_fingerprint(second)
        == {
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
        }
    )
    assert prepared_dir("model", _recipe(first)) == prepared_dir("model", _recipe(second))

    writes: list[Path] = []

    def write(out: Path) -> None:
        writes.append(out)
        (out / "model.safetensors").write_bytes(b"converted")

    a = prepare_once(prepared_dir("model", _recipe(first)), write, _recipe(first))
    b = prepare_once(prepared_dir("model", _recipe(second)), write, _recipe(second))
    assert a == b and is_prepared(a) and len(writes) == 1  # the second install prepared nothing
    assert [p.name for p in cache.iterdir() if p.name != DIGESTS_DIR] == [a.name]


def test_one_changed_byte_is_another_key(tmp_path: Path, cache: Path) -> None:
    data = bytearray(os.urandom(1 << 16))
    source = _install(tmp_path / "venv-a", bytes(data), 1_600_000_000_000_000_000)
    before = prepared_dir("model", _recipe(source))
    data[12345] ^= 0x01
    changed = _install(tmp_path / "venv-b", bytes(data), 1_600_000_000_000_000_000)
    assert file_fingerprint(changed)["size"] == file_fingerprint(source)["size"]
    assert prepared_dir("model", _recipe(changed)) != before


def test_an_unchanged_file_is_hashed_once(tmp_path: Path, cache: Path, hashed: list[Path]) -> None:
    source = _install(tmp_path / "venv", b"a" * 100_000, 1_600_000_000_000_000_000)
    digest = file_digest(source)
    assert file_digest(source) == digest and file_fingerprint(source)["sha256"] == digest
    assert hashed == [source.resolve()]  # later starts read the remembered digest
    assert len(list((cache / DIGESTS_DIR).glob("*.json"))) == 1

    # Rewritten in place (same path and size, new bytes, new mtime): hashed again.
    source.write_bytes(b"b" * 100_000)
    os.utime(source, ns=(1_600_000_000_000_000_001,) * 2)
    assert file_digest(source) == hashlib.sha256(b"b" * 100_000).hexdigest() != digest
    assert len(hashed) == 2

    # A copy elsewhere is another file version: hashed once, the same digest.
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(source, copy)
    assert file_digest(copy) == file_digest(source) and len(hashed) == 3


def test_a_cache_that_cannot_be_written_still_gives_the_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: list[Path]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a file where the cache directory should be
    source = _install(tmp_path / "venv", b"weights", 1_600_000_000_000_000_000)
    assert file_digest(source) == file_digest(source) == hashlib.sha256(b"weights").hexdigest()
    assert len(hashed) == 2  # nothing remembered: each call hashes
