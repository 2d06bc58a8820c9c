"""The CLI contract every command shares: its options, its output rules, its exit paths.

- Options: ``traces_option`` (``--traces PATH``, else ``$MOESCOPE_TRACES``, else the default store),
  ``since_option`` (``--since`` parsed to unix seconds), ``model_option`` (``--model NAME``: one model of a
  store that holds several), ``json_option`` (``--json``); ``option_group`` hands a command its options as one
  frozen dataclass (``cli/config_options.py``: the model, the instrumentation).
- Output: ``emit_json`` is the one JSON rule: ``json.dumps`` with ASCII escapes, so every string (control
  characters and bidi overrides included) is escaped by JSON itself and a parser gets the original text back;
  the same in every command. ``echo`` is for terminals: text goes through ``sanitize`` first.
- Exits: return nothing (0); raise ``CheckFailed`` when a check found a problem (1); raise ``BadInput`` for
  what the user gave us (2). ``cli.main`` turns either into one line on stderr.
- Trace-store reads: ``read_store`` opens the store and a ``CorruptRows`` the readers skip corrupt rows into.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import re
import time
from contextlib import contextmanager
from typing import Any, Iterator

import click

from moescope.errors import BadInput
from moescope.traces.sanitize import sanitize

TRACES_ENV = "MOESCOPE_TRACES"


def default_traces() -> str:
    # start-up: numpy (traces.store), only when the command runs, not for --help
    from moescope.traces.store import DEFAULT_PATH

    return str(DEFAULT_PATH)


def traces_option(*, allow_none: bool = False, help: str = "Trace store (SQLite).", writes: bool = False):
    """``--traces PATH`` into ``traces_path``: the flag, else ``$MOESCOPE_TRACES``, else the default store.
    With ``allow_none``, ``none`` turns tracing off (for commands that write traces). A directory (``DIR/``),
    a glob of directories or a URL is a Parquet trace lake (``traces.lake``)."""
    suffix = " 'none' to disable." if allow_none else ""
    help += (" DIR/ (trailing slash or an existing directory): a Parquet trace lake." if writes else
             " A directory, a glob of directories or an s3:// URL: a Parquet trace lake (read with DuckDB).")
    return click.option("--traces", "traces_path", type=click.Path(), default=default_traces,
                        show_default="~/.local/share/moescope/traces.sqlite", envvar=TRACES_ENV,
                        show_envvar=True, help=help + suffix)


def reference_options(baseline_help: str):
    """What a store's routing is judged against, as the exporter judges it (``diagnose`` and ``report``):
    ``--baseline PATH`` into ``baseline_path`` (``baseline_help`` says how), else ``--hot-reference`` learned (the
    run's first ``--learn-window`` seconds of requests, the later ones judged against it: a finding means the
    routing changed) or fair (uniform routing: the absolute bars)."""
    from moescope.config import DEFAULT_WINDOW_S  # start-up: moescope.config is loaded only by the commands using it

    def apply(f):
        for option in reversed((
                click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
                             help=baseline_help),
                click.option("--hot-reference", "hot_reference", type=click.Choice(["learned", "fair"]),
                             default="learned", show_default=True,
                             help="Without --baseline, what routing is judged against, as the exporter's option: "
                             "learned (the run's first --learn-window seconds of requests, the later ones judged "
                             "against it: a finding means the routing changed) or fair (uniform routing: the "
                             "absolute bars)."),
                click.option("--learn-window", "learn_window_s", type=click.FloatRange(min=0, min_open=True),
                             default=DEFAULT_WINDOW_S, show_default=True,
                             help="Seconds of the run's first requests the learned reference comes from (the "
                             "exporter's --metrics-window)."))):
            f = option(f)
        return f

    return apply


def import_option(use: str):
    """``--import PATH`` into ``import_path``: a peer's expert-load dump (an SGLang expert-distribution dump, .pt,
    or a Megatron-style tokens-per-expert JSONL); ``use`` says what the command does with it."""
    return click.option("--import", "import_path", type=click.Path(dir_okay=False), default=None,
                        help=f"{use} an SGLang expert-distribution dump (.pt) or a Megatron-style tokens-per-expert "
                             "JSONL.")


def option_group(cls, name: str, *options):
    """Click ``options`` whose parsed values reach the command as one frozen ``cls`` object, the keyword ``name``
    (each option's parameter name is a field of ``cls``; a field without its option, or an option without its
    field, fails the first call). Commands take typed objects, never a dict of strings."""
    fields = tuple(f.name for f in dataclasses.fields(cls))

    def deco(fn):
        @functools.wraps(fn)
        def command(*args, **kw):
            kw[name] = cls(**{f: kw.pop(f) for f in fields})
            return fn(*args, **kw)

        for option in reversed(options):
            command = option(command)
        return command

    return deco


def parse_since(text: str) -> float:
    """``30s``, ``5m``, ``2h``, ``1d`` ago, or an ISO timestamp -> unix seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return time.time() - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"--since {text!r}: use a duration (30s, 5m, 2h, 1d) or an ISO timestamp") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


def _since(ctx, param, value: str | None) -> float | None:
    return None if value is None else parse_since(value)


since_option = click.option("--since", callback=_since, default=None, metavar="WHEN",
                            help="Only requests since: 30s, 5m, 2h, 1d ago or an ISO timestamp.")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output (JSON).")
model_option = click.option("--model", "model", default=None, metavar="NAME",
                            help="Only this model's stored requests (a store holding several models; the note on "
                            "such a store names them). Default: the model shape most requests in the window have.")


def no_model_with(model: str | None, source: str | None, what: str) -> None:
    """``BadInput`` when ``--model`` comes with another source than the trace store (``what`` names it)."""
    if model is not None and source is not None:
        raise BadInput(f"--model chooses a model of the trace store: not with {what}")


def emit_json(obj: Any, *, compact: bool = False) -> None:
    """Print ``obj`` as JSON: the one rule for every command's ``--json`` (see the module docstring).
    ``compact``: no indentation, for documents of megabytes (json's C encoder only runs without indent)."""
    if compact:
        click.echo(json.dumps(obj, ensure_ascii=True, default=str, separators=(",", ":")))
    else:
        click.echo(json.dumps(obj, indent=1, ensure_ascii=True, default=str))


def echo(text: str = "", *, err: bool = False) -> None:
    """One line (or lines) for a terminal: stored or remote text never reaches it unsanitised."""
    click.echo(sanitize(text), err=err)


@contextmanager
def read_store(traces_path: str) -> Iterator[tuple[Any, Any]]:
    """(connection, ``CorruptRows``) for a command that reads the trace store; closes the connection."""
    from moescope.traces import store  # start-up: numpy (traces.store), only when the command runs, not for --help

    conn = store.open_store(traces_path)
    try:
        yield conn, store.CorruptRows()
    finally:
        conn.close()
