"""`moescope demo --world-size W`: spawn W rank processes of the same demo and merge their summaries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from moescope.parallel.launch import ENV_STORE

ENV_SUMMARY = "MOESCOPE_SUMMARY_OUT"
TAIL_LINES = 6  # of a failed rank's stderr, shown by the launcher


@dataclass(frozen=True)
class RankFailure:
    """A rank that exited non-zero: its own one-line error (or a note of how it died) and its stderr tail."""

    rank: int
    code: int  # exit code; negative: killed by that signal
    error: str  # its "moescope: error: ..." line, else "exited with code N" / "killed by SIGKILL"
    tail: tuple[str, ...]  # the last lines of its stderr (a traceback's end, when it crashed)
    ended_s: float  # seconds after launch: the first to end is most likely the cause

    @property
    def crashed(self) -> bool:
        """Died without moescope's own one-line error (a traceback, a signal): its tail says why."""
        return not self.error.startswith("moescope: error:")


def run_ranks(argv: list[str], world_size: int, timeout_s: float) -> tuple[list[dict | None], list[RankFailure]]:
    """Run ``moescope <argv>`` as ranks 0..W-1. Returns (per-rank summaries, failed ranks in the order they
    ended). Each rank's stdout and stderr go to their own files, so a dead rank's last words are its own.

    The store lives here, so it outlives any rank. If a rank fails, the others get ``timeout_s`` plus a
    grace period to stop on their own (naming the failed rank), then are killed.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    tmp = Path(tempfile.mkdtemp(prefix="moescope-ranks-"))
    run_id = uuid.uuid4().hex[:10] + "-"  # request ids shared by all ranks: <run>-<index>
    procs, logs = [], []
    t0 = time.monotonic()
    for r in range(world_size):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
               "MOESCOPE_RUN_ID": run_id,
               ENV_STORE: f"127.0.0.1:{store.port}", ENV_SUMMARY: str(tmp / f"rank{r}.json")}
        out, err = open(tmp / f"rank{r}.out", "wb"), open(tmp / f"rank{r}.err", "wb")
        logs += [out, err]
        procs.append(subprocess.Popen([sys.executable, "-m", "moescope", *argv], env=env, stdout=out, stderr=err,
                                      stdin=subprocess.DEVNULL))
    ended: dict[int, float] = {}
    first_failure = None
    terminated: list[int] = []

    def forward(signum, _frame) -> None:  # a SIGTERM/SIGHUP to the launcher ends its ranks, never orphans them
        terminated.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while len(ended) < world_size:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.monotonic() - t0
                    if p.returncode != 0 and first_failure is None:
                        first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > timeout_s + 10:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for log in logs:
            log.close()
    if terminated:  # the ranks ended on the forwarded signal: end as it would have ended us (128 + N)
        raise SystemExit(128 + terminated[0])
    summaries, failures = [], []
    for r, p in enumerate(procs):
        path = tmp / f"rank{r}.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
        if p.returncode != 0:
            failures.append(_failure(r, p.returncode, tmp / f"rank{r}.err", ended.get(r, 0.0)))
    return summaries, sorted(failures, key=lambda f: f.ended_s)


def _failure(rank: int, code: int, err_path: Path, ended_s: float) -> RankFailure:
    lines = [ln for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()]
    error = next((ln for ln in reversed(lines) if ln.startswith("moescope: error:")), None)
    if error is None:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exited with code {code}"
        error = f"rank {rank} {how}"
    return RankFailure(rank, code, error, tuple(lines[-TAIL_LINES:]), ended_s)
