"""``omnirelay check PIPELINE``: validate a pipeline file and print its resolved contracts.

Prints, per stage: id, name, execution type, executor, the resolved ``async_chunk`` and
why, whether it receives chunks, its processors and final output; per edge
(``src -> dst``): the contract (chunks or complete input), the connector (backend and
extras) and the processor; ``--device`` and ``--load-format`` show the file as ``run``
would start it; then the any-stage-chunks flag and the final outputs. Exits
0 when the file validates; otherwise the error (file, stage, key, fix) goes to stderr
and the exit status is 1 (``omnirelay.cli.main`` prints it).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import msgspec

from omnirelay.connectors.device.paths import edge_path, stage_device
from omnirelay.errors import ConfigError
from omnirelay.pipeline import (
    FinalOutputType,
    PipelineConfig,
    StageConfig,
    load_pipeline,
    shipped_pipeline_names,
)
from omnirelay.pipeline.groups import process_groups

__all__ = ["build_report", "register", "render_report", "run_check"]


def register(sub: Any) -> None:
    names = ", ".join(shipped_pipeline_names()) or "none"
    p = sub.add_parser(
        "check",
        help="validate a pipeline file and print each stage's and edge's resolved contract",
        description=(
            "Load and validate a pipeline (a YAML file, or a shipped name: "
            f"{names}). Prints, per stage, the resolved async_chunk mode and why, whether "
            "the stage receives chunks, its processors and final output; per edge, whether "
            "it carries chunks or a complete input, its connector and processor. Exits 1 "
            "with an error naming the file, the stage and the key when the pipeline does not "
            "validate."
        ),
    )
    p.add_argument(
        "pipeline",
        metavar="PIPELINE",
        nargs="?",
        default="voice-cpu",
        help="path to a pipeline YAML file, or a shipped name (default voice-cpu, as run and serve)",
    )
    p.add_argument(
        "--async-chunk",
        choices=("true", "false"),
        default=None,
        help="override the pipeline's async_chunk flag (as `omnirelay serve` would)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="as `omnirelay run --device`: every stage that loads a model on this torch device (cpu, cuda:0)",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy", "tiny"),
        default=None,
        help="as `omnirelay run --load-format` (tiny: the tiny seeded model of a Qwen3-TTS pipeline)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON to PATH")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    override = None if args.async_chunk is None else args.async_chunk == "true"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_pipeline(args.pipeline, async_chunk_override=override)
    if args.device is not None or args.load_format is not None:
        from omnirelay.cli.session import with_model_overrides

        cfg = with_model_overrides(cfg, device=args.device, load_format=args.load_format)
    for w in caught:
        print(f"omnirelay check: warning: {w.message}", file=sys.stderr)
    report = build_report(cfg)
    render_report(report, sys.stdout)
    if args.json:
        path = Path(args.json)
        try:
            path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: cannot write the report: {exc.strerror or exc}") from exc
    return 0


def build_report(cfg: PipelineConfig) -> dict[str, Any]:
    """The resolved pipeline as plain data (what ``--json`` writes)."""
    stages = [_stage_report(cfg, s) for s in cfg.stages]
    edges = [
        {
            "src": e.src,
            "dst": e.dst,
            "label": e.label,
            "names": f"{cfg.stages[e.src].name} -> {cfg.stages[e.dst].name}",
            "contract": e.contract.value,
            "connector": e.connector,
            "backend": e.backend,
            "extra": e.extra,
            "processor": e.processor,
            "input_builder": e.input_builder,
            "path": edge_path(cfg, e)[0].value,
            "path_reason": edge_path(cfg, e)[1],
            "schedule": _schedule_text(e, reproducible=cfg.reproducible),
        }
        for e in cfg.edges()
    ]
    final_outputs = {
        t.value: [s.id for s in cfg.stages if s.final_output and s.final_output_type is t]
        for t in FinalOutputType
    }
    workers = cfg.workers()
    return {
        "name": cfg.name,
        "source": cfg.source,
        "description": cfg.description,
        "async_chunk": cfg.async_chunk,
        "async_chunk_origin": cfg.async_chunk_origin.value,
        "any_stage_chunks": cfg.any_stage_chunks(),
        "max_audio_streams": cfg.max_audio_streams,
        "hold_audio_while_dry": cfg.hold_audio_while_dry,
        "namespace": cfg.namespace,
        "input_wait_timeout_s": cfg.input_wait_timeout_s,
        "openai_voices": dict(cfg.openai_voices),
        "restart": msgspec.structs.asdict(cfg.restart),
        "restart_text": cfg.restart.describe(),
        "placement": {
            "backend": cfg.placement.backend,
            "address": cfg.placement.address,
            "edges": dict(cfg.placement.edges),
        },
        "stages": stages,
        "edges": edges,
        "device_groups": cfg.device_groups.value,
        # the worker processes: the stage ids each hosts (docs/design.md §12)
        "processes": [sorted({workers[i].stage_id for i in g}) for g in process_groups(cfg)],
        "final_outputs": {k: v for k, v in final_outputs.items() if v},
        "final_output_stage_ids": list(cfg.final_output_stage_ids()),
    }


def _stage_report(cfg: PipelineConfig, s: StageConfig) -> dict[str, Any]:
    """One stage of :func:`build_report`."""
    return {
        "id": s.id,
        "name": s.name,
        "execution_type": s.execution_type.value,
        "executor": s.executor,
        "devices": s.devices,
        "device": stage_device(s),
        "max_num_seqs": s.max_num_seqs,
        "async_chunk": s.async_chunk,
        "resolved_async_chunk": cfg.resolved_async_chunk(s),
        "async_chunk_reason": cfg.async_chunk_reason(s),
        "receives_chunks": cfg.stage_receives_chunks(s),
        "receives_chunks_reason": _receives_reason(cfg, s.id),
        "next_stage_processor": cfg.next_stage_processor(s),
        "input_builder": cfg.stage_input_builder(s),
        "final_output": s.final_output,
        "final_output_type": None if s.final_output_type is None else s.final_output_type.value,
        "process_env": s.process_env(),
        "entry": _entry_text(cfg, s.id),
        "resources": dict(s.resources),
        "replicas": [
            {"replica": r, "devices": s.replica_devices_of(r), "resources": s.replica_resources_of(r)}
            for r in range(s.replicas)
        ],
    }


def _entry_text(cfg: PipelineConfig, stage_id: int) -> str | None:
    """Which requests enter at this stage (docs/protocol.md §1.9); None: none do."""
    if stage_id == cfg.audio_entry_stage_id:
        return (
            "requests that carry audio (contract: the complete utterance in, 16 kHz mono; its "
            f"transcript out, forwarded to stage {cfg.prompt_stage_id})"
        )
    if stage_id == cfg.prompt_stage_id:
        if cfg.audio_entry_stage_id is not None:
            return "requests without audio (the prompt stage; audio is heard first by stage 0)"
        return "every request (the prompt stage)"
    return None


def render_report(report: dict[str, Any], out: TextIO) -> None:
    """Human-readable form of :func:`build_report`."""
    w = out.write
    w(f"pipeline {report['name']}  ({report['source']})\n")
    if report["description"]:
        w(f"  {report['description']}\n")
    origin = _ORIGIN_TEXT.get(report["async_chunk_origin"], report["async_chunk_origin"])
    w(f"  async_chunk: {str(report['async_chunk']).lower()} ({origin})\n")
    w(f"  any stage chunks: {_yes(report['any_stage_chunks'])}\n")
    timeout = report["input_wait_timeout_s"]
    w(f"  input wait timeout: {'disabled' if timeout == 0 else f'{timeout:g} s'}\n")
    w(f"  namespace: {report['namespace'] or '(chosen per run)'}\n")
    if report["openai_voices"]:
        pairs = ", ".join(f"{k} -> {v}" for k, v in report["openai_voices"].items())
        w(f"  OpenAI voice names: {pairs}\n")
    w(f"  restart (serve): {report['restart_text']}\n")
    limit = report["max_audio_streams"]
    held = "; new ones also wait while an admitted stream runs dry" if report["hold_audio_while_dry"] else ""
    w(f"  audio streams at once: {limit if limit is not None else 'no fixed limit'}{held}\n")
    placement = report["placement"]
    if placement["backend"] == "ray":
        w(
            f"  placement: Ray cluster at {placement['address'] or 'auto'}; edge backends from where stages run\n"
        )
    else:
        processes = " | ".join("+".join(str(i) for i in p) for p in report["processes"])
        w(f"  placement: local; processes (device_groups: {report['device_groups']}): {processes}\n")
    _render_stages(report["stages"], w)
    _render_edges(report["edges"], w)
    w("\nfinal outputs\n")
    for modality, ids in report["final_outputs"].items():
        w(f"  {modality}: stage {', '.join(str(i) for i in ids)}\n")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _render_stages(stages: list[dict[str, Any]], w: Callable[[str], Any]) -> None:
    w("\nstages\n")
    for s in stages:
        w(f"  [{s['id']}] {s['name']}: {s['execution_type']}, executor {s['executor']}")
        w(f", device {s['device'] or '(default)'}, max_num_seqs {s['max_num_seqs']}\n")
        w(f"      async_chunk: {s['async_chunk_reason']}\n")
        w(f"      receives chunks: {_yes(s['receives_chunks'])} ({s['receives_chunks_reason']})\n")
        if s["entry"]:
            w(f"      entry: {s['entry']}\n")
        if s["next_stage_processor"]:
            w(f"      next-stage processor: {s['next_stage_processor']}\n")
        if s["input_builder"] and not s["receives_chunks"] and s["id"] > 0:
            w(f"      input builder (forwarded input): {s['input_builder']}\n")
        final = s["final_output_type"] if s["final_output"] else "no (intermediate)"
        w(f"      final output: {final}\n")
        if len(s["replicas"]) > 1:
            w(
                f"      replicas: {len(s['replicas'])} worker processes (each request bound to one; load-aware)\n"
            )
            for rep in s["replicas"]:
                where = f"devices {rep['devices'] or '(default)'}"
                if rep["resources"]:
                    where += ", on a Ray node offering " + ", ".join(
                        f"{k}: {v:g}" for k, v in rep["resources"].items()
                    )
                w(f"        replica {rep['replica']}: {where}\n")
        elif s["resources"]:
            res = ", ".join(f"{k}: {v:g}" for k, v in s["resources"].items())
            w(f"      placed on a Ray node offering {res}\n")
        if s["process_env"]:
            env = " ".join(f"{k}={v}" for k, v in s["process_env"].items())
            w(f"      process environment: {env}\n")


def _render_edges(edges: list[dict[str, Any]], w: Callable[[str], Any]) -> None:
    w("\nedges\n")
    if not edges:
        w("  (none)\n")
    for e in edges:
        extras = ", ".join(f"{k}={v}" for k, v in e["extra"].items())
        connector = f"{e['connector']} ({e['backend']}{': ' + extras if extras else ''})"
        if e["contract"] == "chunks":
            via = f"processor {e['processor']}"
        else:
            parts = [f"input builder {e['input_builder'] or '(none: output token ids)'}"]
            if e["processor"]:
                parts.insert(0, f"full processor {e['processor']}")
            via = ", ".join(parts)
        w(f"  {e['label']}  {e['names']}: {e['contract']}\n")
        w(f"      connector {connector}; {via}\n")
        w(f"      tensors: {e['path']} ({e['path_reason']})\n")
        if e["schedule"]:
            w(f"      chunk schedule: {e['schedule']}\n")


def _schedule_text(edge: Any, *, reproducible: bool = False) -> str | None:
    """How a codec edge cuts its chunks (None for other edges)."""
    if edge.contract.value != "chunks" or edge.processor != "talker_to_code2wav":
        return None
    from omnirelay.processors import TalkerToCode2WavConfig

    return TalkerToCode2WavConfig.from_extra(edge.extra, reproducible=reproducible).describe()


_ORIGIN_TEXT = {"default": "the default", "file": "set in the file", "override": "from --async-chunk"}


def _receives_reason(cfg: PipelineConfig, stage_id: int) -> str:
    s = cfg.stages[stage_id]
    if not s.input_sources:
        return "entry stage: it takes the client's request"
    if cfg.stage_receives_chunks(s):
        return "prewarmed with a placeholder; its chunks arrive while the source runs"
    if cfg.resolved_async_chunk(s):
        return "connector_role: sender; the finished source output is forwarded to it"
    return "async_chunk off; the finished source output is forwarded to it"
