"""`moescope demo --world-size W`: run W rank processes of the same demo under torchrun's agent
(``torch.distributed.run``'s in-process ``elastic_launch``, standalone c10d rendezvous, no restarts).

What the agent gives: the ranks' environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT: ``launch.init`` joins the
group on the agent's store), each rank's stdout and stderr in its own file and its error file
(``TORCHELASTIC_ERROR_FILE``: moescope's CLI writes its one-line error there), failure detection, and
signals: a SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to every rank, which then stops serving at a
step every rank agrees on; a rank still running after the shutdown timeout is killed. No rank outlives the
launcher. When a rank fails, the agent sends SIGTERM to the others; a rank blocked in an exchange with the dead
one finishes its own report first (its collective fails at once, or within ``--timeout``, and names the rank),
which the shutdown timeout (``--timeout`` plus a grace period) leaves time for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

ENV_SUMMARY = "MOESCOPE_SUMMARY_DIR"  # each rank writes rank<R>.json there
TAIL_LINES = 6  # of a failed rank's stderr, shown by the launcher
GRACE_S = 10  # past --timeout: how long the agent waits for ranks to end on their own before killing them


@dataclass(frozen=True)
class RankFailure:
    """A rank that failed: its own one-line error (or a note of how it died) and its stderr tail."""

    rank: int
    code: int  # exit code; negative: killed by that signal; 1 when only its error file tells
    error: str  # its "moescope: error: ..." line, else "rank R exited with code N" / "killed by SIGKILL"
    tail: tuple[str, ...]  # the last lines of its stderr (a traceback's end, when it crashed)
    ended_s: float  # when it failed (unix time): the first to fail is most likely the cause

    @property
    def crashed(self) -> bool:
        """Died without moescope's own one-line error (a traceback, a signal): its tail says why."""
        return not self.error.startswith("moescope: error:")


def run_ranks(argv: list[str], world_size: int, timeout_s: float, *, run_dir: Path | None = None,
              signal_stops: bool = False, tee: bool = False) -> tuple[list[dict | None], list[RankFailure]]:
    """Run ``moescope <argv>`` as ranks 0..W-1 under torchrun's agent. Returns (per-rank summaries, failed ranks:
    those the agent saw fail first, then those that left their own error, each group in the order they
    failed). A signal to the launcher ends every rank, then this process (exit 128 + N); with ``signal_stops``
    (a server: SIGTERM is how it stops) it returns once the ranks are gone, as after any run. ``run_dir``: the
    run's directory (the ranks' ``MOESCOPE_SUMMARY_DIR``; made here when None), removed at the end. ``tee``: the
    ranks' output also goes to this process's, as it comes, each line prefixed with its rank (``[default_role<R>]:``,
    the agent's): a server's ranks log while they serve, not only when one fails."""
    # start-up: torch, only when run_ranks() runs
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    tmp = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="moescope-ranks-"))
    run_id = uuid.uuid4().hex[:10]
    env = {"MOESCOPE_RUN_ID": run_id + "-",  # request ids shared by all ranks: <run>-<index>
           # the replica label of every rank's moescope_build_info (a name the user gave, else this launch's id)
           "MOESCOPE_REPLICA": os.environ.get("MOESCOPE_REPLICA") or run_id,
           ENV_SUMMARY: str(tmp), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # (as torchrun sets)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # moescope reports, not the agent
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=run_id,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp / "logs"), redirects=Std.ALL,
                                                      tee=Std.ALL if tee else Std.NONE),
                          signals_to_handle="SIGTERM,SIGINT,SIGHUP",
                          # the agent's kill deadline (torch >= 2.12; older agents wait their fixed 30 s)
                          **({"shutdown_timeout": int(timeout_s) + GRACE_S}
                             if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}))
    first: dict[int, RankFailure] = {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the agent hands its environment to the ranks; ours is put back after
    handlers = {}  # the agent installs its own handlers for the signals it forwards: ours are put back after
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        elastic_launch(config, sys.executable)("-m", "moescope", *argv)
    except SignalException as exc:  # the ranks are gone: end as the signal would have ended us
        if not signal_stops:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        for rank, f in exc.failures.items():
            how = (f"killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 and
                   -f.exitcode in signal.valid_signals() else f"exited with code {f.exitcode}")
            first[rank] = _failure(tmp, rank, f.exitcode, f"rank {rank} {how}", f.timestamp)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # (None: installed outside Python, nothing to put back)
                signal.signal(sig, handler)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    summaries, others = [], []
    for r in range(world_size):
        path = tmp / f"rank{r}.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
        if r not in first:
            own = _own_error(tmp, r)
            if own is not None:
                others.append(_failure(tmp, r, 1, *own))
    shutil.rmtree(tmp, ignore_errors=True)  # read: the failures carry their ranks' last lines
    return summaries, sorted(first.values(), key=lambda f: f.ended_s) + sorted(others, key=lambda f: f.ended_s)


def _rank_dir(tmp: Path, rank: int) -> Path | None:
    found = sorted((tmp / "logs").glob(f"*/attempt_*/{rank}"))
    return found[-1] if found else None


def _own_error(tmp: Path, rank: int) -> tuple[str, float] | None:
    """(its one-line error, when) from the rank's error file, if it left one."""
    d = _rank_dir(tmp, rank)
    try:
        data = json.loads((d / "error.json").read_text())["message"]
        return data["message"], float(data["extraInfo"]["timestamp"])
    except (TypeError, OSError, ValueError, KeyError):
        return None


def _failure(tmp: Path, rank: int, code: int, how: str, when: float) -> RankFailure:
    d = _rank_dir(tmp, rank)
    try:
        lines = [ln for ln in (d / "stderr.log").read_text(errors="replace").splitlines() if ln.strip()]
    except (TypeError, OSError):
        lines = []
    error = next((ln for ln in reversed(lines) if ln.startswith("moescope: error:")), None) or how
    return RankFailure(rank, code, error, tuple(lines[-TAIL_LINES:]), when)


def write_summary(summary: dict) -> bool:
    """Under the launcher, hand the summary back through a file; returns True when it did."""
    where = os.environ.get(ENV_SUMMARY)
    if not where:
        return False
    with open(Path(where) / f"rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(summary, f)
    return True
