"""Checkpoints named by a Hugging Face repo id, resolved through the hub's cache.

The hub is faked by a temporary ``HF_HUB_CACHE`` laid out as ``huggingface_hub`` lays out
a downloaded snapshot (``models--owner--name/blobs/<hash>``, ``snapshots/<revision>/``
of links to the blobs, ``refs/main``), with ``HF_HUB_OFFLINE=1``: nothing is downloaded.
The few tests of the online path replace ``snapshot_download`` itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import huggingface_hub
import msgspec
import pytest

from omnirelay.cli.session import load_run_config
from omnirelay.errors import ModelError
from omnirelay.models import checkpoint_stages, prepare_models, prompt_side, resolve_model
from omnirelay.models.checkpoints import hub_cache_dir, is_repo_id, resolve_checkpoint
from omnirelay.models.qwen3_omni.loader import ModelArgs
from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs, check_checkpoint
from omnirelay.pipeline import PipelineConfig, load_pipeline
from tests.test_models_support import tiny_dir
from tests.test_qwen3_tts_loader import write_checkpoint
from tests.test_voice_chat_model import write_chat_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_snapshot(cache: Path, repo_id: str, write: Callable[[Path], object]) -> Path:
    """``repo_id`` as downloaded into ``cache``: the files ``write(dir)`` makes, each a blob
    named by its hash and linked from the snapshot; ``refs/main`` names the revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    staging = repo / ".staging"
    write(staging)
    snapshot = repo / "snapshots" / REVISION
    for source in sorted(p for p in staging.rglob("*") if p.is_file()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / source.relative_to(staging)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    shutil.rmtree(staging)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def _config_only(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache of its own (HF_HUB_CACHE), empty."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_the_repo_id_shape() -> None:
    for spec in ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", "a/b.c_d-e"):
        assert is_repo_id(spec), spec
    for spec in (
        "/models/x",
        "./x/y",
        "~/x",
        ".x/y",
        "x",
        "a/b/c",
        "a--b/c",
        "a/b..c",
        "a/",
        "/a",
        "a/b.git",
    ):
        assert not is_repo_id(spec), spec


def test_a_cached_repo_id_resolves_to_its_snapshot(hub: Path) -> None:
    snapshot = cache_snapshot(hub, "acme/tiny", _config_only)
    assert resolve_checkpoint("acme/tiny") == Path(resolve_model("acme/tiny")) == snapshot
    assert (snapshot / "config.json").is_symlink() and (snapshot / "config.json").read_text() == "{}"
    assert resolve_model("/no/such/dir") == "/no/such/dir"  # a path stays a path


def test_a_repo_id_not_in_the_cache_is_one_clear_line(hub: Path) -> None:
    with pytest.raises(ModelError) as exc:
        resolve_checkpoint("acme/absent")
    message = str(exc.value)
    assert "\n" not in message
    for part in (
        "'acme/absent'",
        str(hub),
        "HF_HUB_OFFLINE",
        "local checkpoint directory",
        "hf download acme/absent",
    ):
        assert part in message, part


def test_a_local_directory_wins_over_a_repo_id(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_snapshot(hub, "acme/tiny", _config_only)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert not is_repo_id("acme/tiny")
    assert resolve_checkpoint("acme/tiny") == Path("acme/tiny") and resolve_model("acme/tiny") == "acme/tiny"


def test_the_cache_follows_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    snapshot = cache_snapshot(
        tmp_path / "hf-home" / "hub",
        "acme/tiny",
        _config_only,
    )
    assert resolve_checkpoint("acme/tiny") == snapshot


# --------------------------------------------------------------------------- online (faked)


def test_online_the_hub_downloads_inside_the_announcement(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    downloaded = tmp_path / "snapshot"
    calls: list[dict[str, object]] = []

    def snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(downloaded)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    labels: list[str] = []

    def announce(label: str, *, done: str = "ready") -> AbstractContextManager[None]:
        labels.append(label)
        return nullcontext()

    assert resolve_checkpoint("acme/tiny", announce=announce) == downloaded
    assert calls == [{"repo_id": "acme/tiny", "cache_dir": hub}]
    assert labels == [f"fetching acme/tiny from the Hugging Face Hub into {hub}"]


def test_online_a_hub_that_cannot_be_reached_falls_back_to_the_cache(
    hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    real = huggingface_hub.snapshot_download

    def unreachable(repo_id: str, *, cache_dir: Path, local_files_only: bool = False) -> str:
        if local_files_only:
            return real(repo_id, cache_dir=cache_dir, local_files_only=True)
        raise ConnectionError("connection refused")  # a failure outside the hub's own fallback

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    snapshot = cache_snapshot(hub, "acme/tiny", _config_only)
    assert resolve_checkpoint("acme/tiny") == snapshot
    with pytest.raises(ModelError, match=r"'acme/absent' is not in the Hugging Face cache .*ConnectionError"):
        resolve_checkpoint("acme/absent")

    def offline_fallback(repo_id: str, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("cannot find the snapshot and the hub cannot be reached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline_fallback)
    with pytest.raises(ModelError, match="the hub cannot be reached: pass a local checkpoint directory"):
        resolve_checkpoint("acme/absent")


# --------------------------------------------------------------------------- every family


def test_qwen3_omni_loads_a_repo_id_from_the_cache(hub: Path) -> None:
    snapshot = cache_snapshot(hub, "acme/omni-tiny", lambda d: shutil.copytree(tiny_dir(), d))
    config = load_run_config("qwen3-omni-tiny", model="acme/omni-tiny")
    assert {s.executor_args["model_dir"] for s in config.stages} == {str(snapshot.resolve())}
    # A pipeline file that names the repo id itself: each stage process finds it cached.
    assert ModelArgs(model_dir="acme/omni-tiny").resolve_dir() == snapshot
    yaml_config = load_run_config("qwen3-omni-tiny", device="cpu")
    prompts = prompt_side(_with_model_dir(yaml_config, "acme/omni-tiny"))
    assert prompts is not None and prompts.encode_prompt("hi")
    with pytest.raises(ModelError, match="'acme/omni-absent' is not in the Hugging Face cache"):
        load_run_config("qwen3-omni-tiny", model="acme/omni-absent")


def test_qwen3_tts_loads_a_repo_id_from_the_cache(hub: Path) -> None:
    snapshot = cache_snapshot(hub, "acme/tts-tiny", write_checkpoint)
    config = load_run_config("qwen3-tts-tiny", model="acme/tts-tiny")
    ids, _ = checkpoint_stages(config)
    assert ids == [0, 1]  # the Talker and Code2Wav, not the aligner
    assert {config.stages[i].executor_args["model_dir"] for i in ids} == {str(snapshot.resolve())}
    checkpoint = TTSCheckpoint.open(TTSModelArgs(model_dir="acme/tts-tiny"))
    assert checkpoint.directory == snapshot and checkpoint.load_talker() is not None
    with pytest.raises(ModelError, match="'acme/tts-absent' is not in the Hugging Face cache"):
        check_checkpoint("acme/tts-absent", "auto")


def test_the_voice_thinker_loads_a_repo_id_from_the_cache(hub: Path) -> None:
    snapshot = cache_snapshot(hub, "acme/chat-tiny", write_chat_model)
    config = load_run_config("voice-cpu", model="acme/chat-tiny")
    assert config.stages[1].executor_args["model_dir"] == str(snapshot.resolve())
    # Named in the pipeline file: prepared (fetched) quietly from the cache, then opened.
    named = _with_model_dir(load_pipeline("voice-cpu"), "acme/chat-tiny")
    labels: list[str] = []

    def announce(label: str, *, done: str = "ready") -> AbstractContextManager[None]:
        labels.append(label)
        return nullcontext()

    prepare_models(named.stages, announce)
    assert [label for label in labels if "acme" in label] == []  # offline and cached: nothing to fetch
    prompts = prompt_side(named)
    assert prompts is not None and prompts.encode_prompt("hi")[:2] == prompts.encode_prompt("ho")[:2]
    with pytest.raises(ModelError, match="'acme/chat-absent' is not in the Hugging Face cache"):
        prepare_models(_with_model_dir(load_pipeline("voice-cpu"), "acme/chat-absent").stages)


def _with_model_dir(config: PipelineConfig, repo_id: str) -> PipelineConfig:
    """``config`` with ``model_dir: repo_id`` in each stage that loads a checkpoint."""
    ids, options = checkpoint_stages(config)
    assert options is not None

    def named(args: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in args.items() if k not in options.source_keys}, "model_dir": repo_id}

    stages = tuple(
        msgspec.structs.replace(s, executor_args=named(dict(s.executor_args))) if s.id in ids else s
        for s in config.stages
    )
    return msgspec.structs.replace(config, stages=stages)
