"""Inductor's on-disk cache for the compiled code-predictor tail: under omnirelay's own
cache directory, one folder per model config, torch version, device and dtype; a folder
the environment named is left as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnirelay.models.runner import predictor
from omnirelay.models.runner.predictor import keyed_compile_cache, use_compile_cache


class _Config:
    def __init__(self, layers: int) -> None:
        self.layers = layers

    def to_dict(self) -> dict[str, int]:
        return {"layers": self.layers}


def test_each_config_device_and_dtype_gets_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(predictor, "_OWN_CACHE", None)
    cpu = torch.device("cpu")
    assert keyed_compile_cache(_Config(2), cpu, torch.float32) is None  # no cache chosen yet
    root = use_compile_cache(tmp_path)
    assert root == tmp_path / "inductor"
    a = keyed_compile_cache(_Config(2), cpu, torch.float32)
    assert a is not None and a.parent == root and a.is_dir()
    assert Path(predictor.os.environ["TORCHINDUCTOR_CACHE_DIR"]) == a  # inductor writes there
    assert keyed_compile_cache(_Config(2), cpu, torch.float32) == a  # the same recipe: the same folder
    assert keyed_compile_cache(_Config(3), cpu, torch.float32) not in (a, None)
    assert keyed_compile_cache(_Config(2), cpu, torch.bfloat16) not in (a, None)


def test_a_folder_the_environment_names_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(predictor, "_OWN_CACHE", None)
    assert use_compile_cache(tmp_path) == tmp_path / "mine"
    assert keyed_compile_cache(_Config(2), torch.device("cpu"), torch.float32) == tmp_path / "mine"


def test_torchs_default_folder_written_by_another_stage_is_not_a_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stage built first in the same process asked inductor for its folder: torch wrote
    # its default into the environment. The Talker built next still keys its own.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(predictor, "_OWN_CACHE", None)
    default = cache_dir()  # what torch does on first use
    assert predictor.os.environ["TORCHINDUCTOR_CACHE_DIR"] == default
    assert keyed_compile_cache(_Config(2), torch.device("cpu"), torch.float32) is None
    root = use_compile_cache(tmp_path)
    assert root == tmp_path / "inductor"
    a = keyed_compile_cache(_Config(2), torch.device("cpu"), torch.float32)
    assert a is not None and a.parent == root
    # A second Talker stage of the process finds the folder already chosen by omnirelay.
    assert use_compile_cache(tmp_path / "elsewhere") == root
