"""What every benchmark shares: its command line (``--quick``, ``--out``, ``--rounds``), where it writes its figures
(the README and docs quote them from benchmarks/results/; a ``--quick`` run writes ``<name>-quick.json``, ignored
by git, never the figures the docs quote) and its progress on stderr (moescope/progress.py: a bar with the time
left on a terminal, start and done lines otherwise, ``MOESCOPE_PROGRESS=0`` off).

    ap = _results.parser(__doc__, quick="1 round, 12 requests (CI keeps the script working)", rounds=7)
    ap.add_argument("--requests", type=int, default=48)
    args = _results.parse(ap, argv, "eplb")  # args.out: --out or results/eplb[-quick].json; args.rounds: 1 quick
    for i in _results.track(range(args.rounds), "eplb: interleaved rounds"):
        ...
    _results.save(report, args.out)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import _measures
from moescope.progress import progress

RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")


def parser(doc: str, *, quick: str, rounds: int | None = None) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: ``--quick`` (``quick`` says what it runs), ``--out`` and, where the
    benchmark repeats its measurement, ``--rounds`` (default ``rounds``; one under ``--quick`` unless given)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=Path, default=None, help="results file (default: benchmarks/results/NAME.json, "
                    "NAME-quick.json under --quick)")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds [{rounds}; --quick: 1]")
        ap.set_defaults(full_rounds=rounds)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None, name: str | Callable[[argparse.Namespace], str],
          *, quick_rounds: int | Callable[[argparse.Namespace], int] = 1) -> argparse.Namespace:
    """Parsed arguments with ``out`` resolved and ``rounds`` set (``--rounds``, else ``quick_rounds`` under
    ``--quick``, else the benchmark's default). ``name`` (the results file's stem) and ``quick_rounds`` may be
    functions of the arguments, for a benchmark whose file or quick length depends on them (the device)."""
    args = ap.parse_args(argv)
    started()
    if args.out is None:
        args.out = path(name(args) if callable(name) else name, args.quick)
    if hasattr(args, "full_rounds"):
        quick = quick_rounds(args) if callable(quick_rounds) else quick_rounds
        args.rounds = args.rounds or (quick if args.quick else args.full_rounds)
    return args


def started() -> None:
    """Records the code measured: HEAD when the run starts (a commit made meanwhile is not it). ``parse`` calls
    it; a run that does not parse arguments here (a pytest module writing results) calls it before it measures."""
    global _STARTED
    _STARTED = _git_state()


def path(stem: str, quick: bool) -> Path:
    """benchmarks/results/STEM.json, or STEM-quick.json for a ``--quick`` run."""
    return RESULTS / f"{stem}{'-quick' if quick else ''}.json"


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """``items`` one by one, with progress on stderr (``total``: for an iterable without a length)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    with progress(description, total if total is not None else len(items)) as advance:
        for item in items:
            yield item
            advance()


_STARTED: dict | None = None  # ``_git_state()`` at ``started()`` (the run's start)


def _git(*args: str) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=RESULTS.parent.parent, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_state() -> dict:
    return {"commit": _git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": bool(_git("status", "--porcelain", "--", "moescope", "benchmarks",
                                                    ":(exclude)benchmarks/results"))}


def provenance(packages: Iterable[str] = ("torch",), results: str | Path | None = None) -> dict:
    """How a results file was made: the commit when the run started (and whether the tree had uncommitted changes;
    ``commit_at_save`` where HEAD moved during the run), the exact command,
    the date, the machine (cores, load average, CPU model, GPU if any), the versions of ``packages`` and, given the
    file it is for (``results``), the code it measures (``measures``: benchmarks/_measures.py; ``python
    benchmarks/_doc_tables.py --check`` fails the file once that code changes and nothing re-runs it)."""
    import datetime
    import os
    import platform
    import shlex
    import sys
    from importlib import metadata

    cpu = None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   None)
    except OSError:
        pass
    gpu = None
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 (no torch, no driver: no GPU to name)
        gpu = None
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    now = _git_state()
    start = _STARTED or now
    moved = {"commit_at_save": now["commit"]} if now["commit"] != start["commit"] else {}
    return {**start, **moved,
            "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], RESULTS.parent.parent)
                                                         if sys.argv and sys.argv[0] else "python",
                                                         *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
                        "cpu": cpu, "gpu": gpu, "platform": platform.platform(),
                        "python": platform.python_version()},
            "packages": versions,
            **({"measures": list(_measures.of(results) or ())} if results is not None else {})}


def save(report, path: Path, packages: Iterable[str] = ("torch",)) -> None:
    """Write ``report`` (a dict gets ``provenance``: ``provenance(packages, path)``, unless it has one; one without
    ``measures`` gets them)."""
    if isinstance(report, dict) and "provenance" not in report:
        report = {**report, "provenance": provenance(packages, path)}
    elif isinstance(report, dict) and "measures" not in report["provenance"]:
        report = {**report, "provenance": {**report["provenance"], "measures": list(_measures.of(path) or ())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


__all__ = ["RESULTS", "parser", "parse", "path", "progress", "provenance", "save", "started", "track"]
