"""KV slots sized from the device memory a process's stages leave: the pure arithmetic
(made-up figures), the budget's build order (every stage's KV before any graph), the
tiny Qwen3-Omni executors deferring their runners to it (CPU), which processes size
their slots, and the pipeline file's ``gpu_memory_utilization``."""

from __future__ import annotations

import pytest

from omnirelay.errors import ConfigError, ModelError
from omnirelay.models.runner.memory import DeviceBudget, SlotNeed, activate, plan_slots, provision
from omnirelay.pipeline import load_pipeline
from omnirelay.pipeline.groups import sizing_device
from tests.memory_fakes import GIB, FakeMemory


def _need(
    stage: str, slot_gib: float, fixed_gib: float = 0.0, cap: int = 64, given: int | None = None
) -> SlotNeed:
    return SlotNeed(stage, int(slot_gib * GIB), int(fixed_gib * GIB), cap=cap, given=given)


def test_every_sized_stage_gets_the_same_count_of_what_fits() -> None:
    # 0.9 x 80 = 72 GiB; 62 in use; 10 left; 1 fixed; 9 / (0.2 + 0.05) = 36
    needs = [_need("thinker", 0.2, 0.75), _need("talker", 0.05, 0.25)]
    plan = plan_slots(needs, free_bytes=18 * GIB, total_bytes=80 * GIB, fraction=0.9)
    assert plan == {"thinker": 36, "talker": 36}


def test_the_count_is_capped_by_the_smallest_max_num_seqs() -> None:
    needs = [_need("thinker", 0.01, cap=64), _need("talker", 0.01, cap=24)]
    plan = plan_slots(needs, free_bytes=40 * GIB, total_bytes=80 * GIB, fraction=0.9)
    assert plan == {"thinker": 24, "talker": 24}


def test_a_given_count_wins_and_its_memory_is_taken_first() -> None:
    # 10 GiB left; the given 20 slots take 4; 6 / 0.25 = 24 for the sized one
    needs = [_need("thinker", 0.2, given=20), _need("talker", 0.25)]
    plan = plan_slots(needs, free_bytes=18 * GIB, total_bytes=80 * GIB, fraction=0.9)
    assert plan == {"thinker": 20, "talker": 24}


def test_a_given_count_is_kept_past_the_share_and_named_when_nothing_is_left() -> None:
    # 10 GiB left; the given 64 slots take 12.8 (their allocation checks the free memory)
    given = _need("thinker", 0.2, given=64)
    assert plan_slots([given], free_bytes=18 * GIB, total_bytes=80 * GIB, fraction=0.9) == {"thinker": 64}
    with pytest.raises(ModelError) as err:
        plan_slots([given, _need("talker", 0.05)], free_bytes=18 * GIB, total_bytes=80 * GIB, fraction=0.9)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "not even one KV slot fits after the slots executor_args.max_num_seqs gives (thinker 64)"
    )
    assert "lower executor_args.max_num_seqs" in message and "gpu_memory_utilization" in message


def test_not_even_one_slot_is_one_line_with_the_shortfall_and_the_knobs() -> None:
    # 0.9 x 80 = 72 GiB; 71.5 in use: 0.5 left; fixed 0.4; one slot needs 0.3: 0.2 short
    needs = [_need("thinker", 0.25, 0.3), _need("talker", 0.05, 0.1)]
    with pytest.raises(ModelError) as err:
        plan_slots(needs, free_bytes=int(8.5 * GIB), total_bytes=80 * GIB, fraction=0.9)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("not even one KV slot fits: 0.20 GiB short")
    for knob in ("gpu_memory_utilization", "executor_args.max_model_len", "another device"):
        assert knob in message


def test_more_in_use_than_the_share_is_not_even_one_slot() -> None:
    with pytest.raises(ModelError, match="not even one KV slot fits"):
        plan_slots([_need("talker", 0.05)], free_bytes=4 * GIB, total_bytes=80 * GIB, fraction=0.9)


def test_the_share_must_be_a_fraction() -> None:
    with pytest.raises(ModelError, match="gpu_memory_utilization"):
        plan_slots([_need("talker", 0.05)], free_bytes=40 * GIB, total_bytes=80 * GIB, fraction=1.5)


def _provision(memory: FakeMemory, events: list[str], name: str, slot_gib: float, given: int | None) -> None:
    def build(n: int) -> None:
        events.append(f"build {name} {n}")
        memory.allocated_bytes += int(n * slot_gib * GIB)

    def capture() -> None:
        events.append(f"capture {name}")
        memory.pools += GIB // 2

    provision(
        device="cuda:0",
        max_len=2048,
        given=given,
        default=64,
        slot_bytes=int(slot_gib * GIB),
        fixed_bytes=GIB // 2,
        weights_bytes=3 * GIB,
        build=build,
        capture=capture,
    )


def test_the_budget_builds_every_kv_before_any_graph_and_says_one_line_per_stage() -> None:
    memory, events, lines = FakeMemory(in_use_gib=62), list[str](), list[str]()
    budget = DeviceBudget("cuda:0", 0.9, memory=memory)
    with activate(budget):
        budget.stage = ("thinker", 64)
        _provision(memory, events, "thinker", 0.2, None)
        budget.stage = ("talker", 64)
        _provision(memory, events, "talker", 0.05, None)
    assert events == [] and budget.is_pending  # nothing before every stage's weights
    slots = budget.finish(lines.append)
    # 72 - 62 = 10 GiB; 2 x 0.5 fixed; 9 / 0.25 = 36
    assert slots == {"thinker": 36, "talker": 36}
    assert events == ["build thinker 36", "build talker 36", "capture thinker", "capture talker"]
    assert lines == [
        "omnirelay: thinker on cuda:0: weights 3.00 GiB, KV 36 slots x 2048 positions (7.20 GiB, sized from "
        "memory), graph pools 0.50 GiB",
        "omnirelay: talker on cuda:0: weights 3.00 GiB, KV 36 slots x 2048 positions (1.80 GiB, sized from "
        "memory), graph pools 0.50 GiB",
    ]
    assert not budget.is_pending


def test_without_a_budget_of_its_device_a_runner_is_built_at_once() -> None:
    memory, events = FakeMemory(in_use_gib=0), list[str]()
    _provision(memory, events, "thinker", 0.2, None)
    _provision(memory, events, "talker", 0.2, 8)
    with activate(DeviceBudget("cuda:1", 0.9, memory=memory)) as other:
        _provision(memory, events, "code", 0.2, None)
    assert other is not None and not other.is_pending
    assert events == [
        *("build thinker 64", "capture thinker"),
        *("build talker 8", "capture talker"),
        *("build code 64", "capture code"),
    ]


def test_a_failed_sizing_builds_nothing() -> None:
    memory, events = FakeMemory(in_use_gib=71.9), list[str]()
    budget = DeviceBudget("cuda:0", 0.9, memory=memory)
    with activate(budget):
        _provision(memory, events, "thinker", 0.2, None)
    with pytest.raises(ModelError, match="not even one KV slot fits"):
        budget.finish(lambda line: None)
    assert events == []


def test_the_tiny_executors_defer_their_runners_to_the_budget() -> None:
    from omnirelay.models.qwen3_omni import create_talker, create_thinker

    class _Cpu(FakeMemory):
        def free_and_total(self) -> tuple[int, int]:
            return 8 * GIB, 80 * GIB  # 72 in use: the 0.95 share leaves 4 GiB

    lines: list[str] = []
    budget = DeviceBudget("cpu", 0.95, memory=_Cpu(0))
    args = {"tiny": True, "device": "cpu", "runner": "static", "max_model_len": 64}
    with activate(budget):
        budget.stage = ("thinker", 3)
        thinker = create_thinker(**args)
        thinker.keep_outputs_on_device(True)  # the engine's call, before the sizing
        budget.stage = ("talker", 5)
        talker = create_talker(**args)
        budget.stage = ("fixed", 64)
        fixed = create_thinker(**args, max_num_seqs=2)
    assert thinker.runner is None and talker.runner is None
    assert fixed.runner is None  # a given count waits too: its memory is taken first
    assert budget.finish(lines.append) == {"thinker": 3, "talker": 3, "fixed": 2}
    assert thinker.runner is not None and talker.runner is not None and fixed.runner is not None
    assert (thinker.runner.slots.num_slots, talker.runner.slots.num_slots, fixed.runner.slots.num_slots) == (
        3,
        3,
        2,
    )
    assert thinker.runner.kv.cache.shape[2] == 4  # three slots and the scratch row
    assert not thinker.runner.keep_hidden_on_device  # the CPU keeps rows on the host
    assert [line.split(":")[1].strip().split()[0] for line in lines] == ["thinker", "talker", "fixed"]


_YAML = """
name: sizing
async_chunk: false
device_groups: {groups}
{share}
stages:
  - {{id: 0, name: a, execution_type: ar, executor: toy.upper, devices: "{d0}", final_output: true,
      final_output_type: text}}
  - {{id: 1, name: b, execution_type: ar, executor: toy.upper, devices: "{d1}", input_sources: [0],
      final_output: true, final_output_type: text}}
"""


def _pipeline(
    tmp_path: pytest.TempPathFactory, d0: str, d1: str, share: str = "", groups: str = "auto"
) -> object:
    path = tmp_path / "p.yaml"  # type: ignore[operator]
    path.write_text(_YAML.format(d0=d0, d1=d1, share=share, groups=groups))
    return load_pipeline(str(path))


def test_which_processes_size_their_slots(tmp_path: pytest.TempPathFactory) -> None:
    same = _pipeline(tmp_path, "cuda:0", "cuda")
    assert sizing_device(same, (0, 1)) == "cuda:0"  # type: ignore[arg-type]
    # a process per stage on one device: each would count the other's memory as its own
    assert sizing_device(same, (0,)) is None  # type: ignore[arg-type]
    apart = _pipeline(tmp_path, "cuda:0", "cuda:1")
    assert sizing_device(apart, (0,)) == "cuda:0"  # type: ignore[arg-type]
    assert sizing_device(apart, (1,)) == "cuda:1"  # type: ignore[arg-type]
    assert sizing_device(apart, (0, 1)) is None  # type: ignore[arg-type]
    cpu = _pipeline(tmp_path, "cpu", "cpu", groups="on")
    assert sizing_device(cpu, (0, 1)) is None  # type: ignore[arg-type]


def test_the_share_is_read_from_the_pipeline_file(tmp_path: pytest.TempPathFactory) -> None:
    assert _pipeline(tmp_path, "cpu", "cpu").gpu_memory_utilization == 0.9  # type: ignore[attr-defined]
    cfg = _pipeline(tmp_path, "cpu", "cpu", share="gpu_memory_utilization: 0.95")
    assert cfg.gpu_memory_utilization == 0.95  # type: ignore[attr-defined]
    for bad in ("0", "1.2", "high"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            _pipeline(tmp_path, "cpu", "cpu", share=f"gpu_memory_utilization: {bad}")


class _Stage:
    def __init__(self, label: str, max_num_seqs: int) -> None:
        self.label, self.max_num_seqs = label, max_num_seqs


class _Spec:
    def __init__(self, stage_id: int, stages: list[_Stage]) -> None:
        self.stage_id = stage_id
        self.pipeline = type("P", (), {"stages": stages})()


class _Engine:
    def __init__(self) -> None:
        self.limits: list[int] = []

    def limit_slots(self, n: int) -> int:
        self.limits.append(n)
        return n


class _Control:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object, **kwargs: object) -> None:
        self.sent.append(message)


def _group(in_use_gib: float) -> tuple[list[_Spec], list[_Engine], list[_Control], DeviceBudget]:
    stages = [_Stage("thinker", 64), _Stage("talker", 64), _Stage("code2wav", 64)]
    specs = [_Spec(i, stages) for i in range(3)]
    memory, events = FakeMemory(in_use_gib), list[str]()
    budget = DeviceBudget("cuda:0", 0.9, memory=memory)
    with activate(budget):
        for name in ("thinker", "talker"):
            budget.stage = (name, 64)
            _provision(memory, events, name, 0.2, None)
    return specs, [_Engine() for _ in specs], [_Control() for _ in specs], budget


def test_a_group_limits_each_sized_stage_to_its_slots_and_says_so_in_its_hello() -> None:
    from omnirelay.worker.main import _size_slots

    specs, engines, controls, budget = _group(in_use_gib=62)
    capacities = _size_slots(specs, engines, controls, budget, lambda: True)  # type: ignore[arg-type]
    # 10 GiB left, 1 fixed, 9 / 0.4 = 22 slots each; Code2Wav keeps its max_num_seqs
    assert capacities == [22, 22, 64]
    assert [e.limits for e in engines] == [[22], [22], []]
    assert all(c.sent == [] for c in controls)


def test_a_group_whose_slots_do_not_fit_fails_each_stage_with_the_one_line() -> None:
    from omnirelay.worker.main import _size_slots
    from omnirelay.worker.messages import StartupFailed

    specs, engines, controls, budget = _group(in_use_gib=71.9)
    assert _size_slots(specs, engines, controls, budget, lambda: True) is None  # type: ignore[arg-type]
    for spec, control in zip(specs, controls, strict=True):
        (failed,) = control.sent
        assert isinstance(failed, StartupFailed) and failed.stage_id == spec.stage_id
        assert failed.error.startswith("not even one KV slot fits") and "\n" not in failed.error
    assert all(e.limits == [] for e in engines)
