"""``omnirelay doctor``: list transfer objects on this host; reclaim dead owners' objects;
say whether the shm connector can run, whether Ray and NIXL (for pipelines across hosts)
are installed, and which Python build runs omnirelay.

:func:`check_multihost` is the same question asked by ``run`` and ``serve`` before they
start anything: a pipeline placed on Ray (or ``--local-cluster``) needs Ray, an edge that
resolves to ``nixl`` needs NIXL; a missing one is one line naming what to install.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirelay.connectors import reclaim_namespace
from omnirelay.errors import PipelineError
from omnirelay.interpreter import SLOW_BUILD_ADVICE, interpreter_info

if TYPE_CHECKING:
    from omnirelay.pipeline import PipelineConfig

__all__ = ["NIXL_INSTALL", "check_multihost", "multihost_problem", "ray_install", "ray_version", "register"]

#: NIXL's wheel, without its declared requirements (they pull a CUDA build of torch).
NIXL_INSTALL = "pip install --no-deps 'nixl-cu12>=1.5,<2'"


def ray_version() -> str | None:
    """The version of the Ray that imports here; None when none does."""
    try:
        ray = importlib.import_module("ray")
    except ImportError:
        return None
    return str(getattr(ray, "__version__", "unknown version"))


def ray_install() -> str:
    """The command that installs Ray: the checkout's ``multihost`` extra (Ray alone) when
    omnirelay runs from a checkout, else Ray's wheel in the range that extra gives."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        return "pip install 'ray>=2.40,<3'"
    command = "pip install -e '.[multihost]'"
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the working directory is gone
        here = False
    return command if here else f"cd {shlex.quote(str(root))} && {command}"


def _nixl_installed() -> bool:
    from omnirelay.connectors.nixl import unavailable_reason

    return unavailable_reason() is None


def multihost_problem(config: PipelineConfig, *, local_cluster: bool = False) -> str | None:
    """What running ``config`` (on a ``--local-cluster``) lacks on this machine: one line
    naming the missing packages and the commands that install them; None when nothing."""
    missing: list[tuple[str, str]] = []
    commands: list[str] = []
    if (local_cluster or config.placement.is_ray) and ray_version() is None:
        missing.append(("Ray", "--local-cluster" if local_cluster else "placement backend ray"))
        commands.append(ray_install())
    nixl_edges = [f"{e.src} -> {e.dst}" for e in config.edges() if e.backend == "nixl"]
    if nixl_edges and not _nixl_installed():
        word = "edge" if len(nixl_edges) == 1 else "edges"
        missing.append(("NIXL", f"{word} {', '.join(nixl_edges)} over nixl"))
        commands.append(NIXL_INSTALL)
    if not missing:
        return None
    needs = " and ".join(f"{name} ({why})" for name, why in missing)
    verb = "is" if len(missing) == 1 else "are"
    return f"pipeline {config.name!r} needs {needs}, which {verb} not installed: {' && '.join(commands)}"


def check_multihost(config: PipelineConfig, *, local_cluster: bool = False) -> None:
    """:func:`multihost_problem` as a :class:`PipelineError` (before anything starts)."""
    problem = multihost_problem(config, local_cluster=local_cluster)
    if problem is not None:
        raise PipelineError(problem)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="list omnirelay objects in /dev/shm; --reclaim removes those of dead processes",
        description=(
            "Lists every omnirelay transfer object on this host, by namespace, with its owner "
            "process (alive or dead), age and size. Published objects show the transfer key they "
            "carry. With --reclaim, objects whose owner process is dead are removed; objects of "
            "live processes are never touched. It also says whether the shm connector can run here, "
            "whether NIXL and Ray (for pipelines across hosts) are installed, and which Python build "
            "runs omnirelay, with a warning for builds known to be slow."
        ),
    )
    p.add_argument("--namespace", help="only this deployment namespace (default: all)")
    p.add_argument("--reclaim", action="store_true", help="remove objects whose owner process is dead")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--shm-dir", default="/dev/shm", help=argparse.SUPPRESS)
    p.set_defaults(func=run_doctor)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def run_doctor(args: argparse.Namespace) -> int:
    report = reclaim_namespace(args.namespace, reclaim=args.reclaim, shm_dir=args.shm_dir)
    objs = report.objects
    if not objs:
        print(
            "no omnirelay objects in /dev/shm"
            + (f" for namespace {args.namespace!r}" if args.namespace else "")
        )
    else:
        by_ns: dict[str, list[Any]] = {}
        for o in objs:
            by_ns.setdefault(o.namespace, []).append(o)
        for ns, items in sorted(by_ns.items()):
            total = sum(o.size for o in items)
            print(f"namespace {ns}: {len(items)} objects, {_human(total)}")
            print(f"  {'kind':<7} {'owner':>8} {'alive':<6} {'age':>8} {'size':>10} {'state':<10} key / name")
            for o in items:
                alive = {True: "yes", False: "DEAD", None: "?"}[o.owner_alive]
                what = repr(o.key) if o.key is not None else o.name
                if len(what) > 60:
                    what = what[:57] + "..."
                mark = "  (reclaimed)" if o.reclaimed else ""
                print(
                    f"  {o.kind:<7} {o.owner_pid or '-':>8} {alive:<6} {o.age_s:>7.1f}s "
                    f"{_human(o.size):>10} {o.state or '-':<10} {what}{mark}"
                )
    dead = [o for o in objs if o.owner_alive is False]
    if args.reclaim:
        print(
            f"reclaimed {len(report.reclaimed)} objects ({_human(sum(o.size for o in report.reclaimed))}) of dead owners"
        )
    elif dead:
        print(
            f"{len(dead)} objects belong to dead processes; run `omnirelay doctor --reclaim` to remove them"
        )
    from omnirelay.connectors.shm import atomics, notices

    if atomics.available():
        print(
            f"shm connector: ready (lock-free 8-byte atomics: {atomics.backend()}; "
            f"arrival notices: {notices.backend()})"
        )
    else:
        print(f"shm connector: UNAVAILABLE: {atomics.unavailable_reason()}")
    from omnirelay.connectors.nixl import unavailable_reason as nixl_problem

    nixl_reason = nixl_problem()
    # Optional: only pipelines whose edges cross hosts need it (not a failure of doctor).
    print(
        "nixl connector: ready" if nixl_reason is None else f"nixl connector: not installed ({nixl_reason})"
    )
    # Optional too: only pipelines placed on Ray hosts (and --local-cluster) need it.
    ray = ray_version()
    ray_problem = None if ray is not None else f"Ray is not installed: {ray_install()}"
    print(
        f"ray placement: ready (Ray {ray})"
        if ray is not None
        else f"ray placement: not installed ({ray_problem})"
    )
    interp = interpreter_info()
    print(f"python: {interp.describe()}")
    if interp.is_likely_slow:
        print(f"  warning: {SLOW_BUILD_ADVICE}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = report.to_dict()
        out["shm_connector_ready"] = atomics.available()
        out["shm_connector_problem"] = atomics.unavailable_reason()
        out["shm_atomics"] = atomics.backend()
        out["shm_notices"] = notices.backend()
        out["python"] = interp.to_dict()
        out["nixl_connector_problem"] = nixl_reason
        out["ray_version"] = ray
        out["ray_problem"] = ray_problem
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if atomics.available() else 1
