"""The public surface: ``from omnirelay import …`` (docs/api.md).

* every name in ``omnirelay.__all__`` resolves, to the object its home module defines,
  and ``__all__`` lists each once;
* ``import omnirelay`` loads no torch (the names are imported on first use);
* ``Pipeline.start`` takes the user's settings as keywords or as
  :class:`PipelineOptions`, and refuses a runtime hook given as a setting, saying where
  it goes.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import omnirelay
from omnirelay import ConfigError, Pipeline, PipelineOptions, RuntimeHooks


def test_every_public_name_resolves_to_its_home() -> None:
    names = omnirelay.__all__
    assert len(names) == len(set(names))
    assert set(names) == {*omnirelay._HOME_OF, "__version__"}
    for name in names:
        if name == "__version__":
            continue
        home = importlib.import_module(omnirelay._HOME_OF[name])
        assert getattr(omnirelay, name) is getattr(home, name), name
    assert set(dir(omnirelay)) >= set(names)
    with pytest.raises(AttributeError):
        _ = omnirelay.no_such_name  # type: ignore[attr-defined]


def test_importing_omnirelay_loads_no_torch() -> None:
    code = "import sys, omnirelay; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_are_one_hierarchy() -> None:
    errors = [getattr(omnirelay, n) for n in omnirelay.__all__ if n.endswith("Error")]
    assert errors and all(issubclass(e, omnirelay.OmniRelayError) for e in errors)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"engine_factory": "x:y"}, r"runtime hook.*runtime=RuntimeHooks\(engine_factory=...\)"),
        ({"wait_slice_s": 0.5}, r"runtime hook"),
        ({"no_such_option": 1}, r"unknown pipeline option 'no_such_option'"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s must be a number > 0"),
        ({"trace_steps": "yes"}, r"trace_steps must be True or False"),
    ],
)
def test_start_refuses_wrong_settings_before_anything_starts(settings: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Pipeline.start("toy-3stage", **settings)


def test_options_and_keywords_are_not_mixed() -> None:
    with pytest.raises(ConfigError, match="not both"):
        Pipeline.start("toy-3stage", PipelineOptions(), namespace="x")
    with pytest.raises(ConfigError, match="idle_wait_s"):
        RuntimeHooks(idle_wait_s=-1)
