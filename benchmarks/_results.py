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
    if args.out is None:
        args.out = path(name(args) if callable(name) else name, args.quick)
    if hasattr(args, "full_rounds"):
        quick = quick_rounds(args) if callable(quick_rounds) else quick_rounds
        args.rounds = args.rounds or (quick if args.quick else args.full_rounds)
    return args


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


def save(report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


__all__ = ["RESULTS", "parser", "parse", "path", "progress", "save", "track"]
