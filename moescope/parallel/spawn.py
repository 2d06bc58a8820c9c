"""`moescope demo --world-size W`: spawn W rank processes of the same demo and merge their summaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from moescope.parallel.launch import ENV_STORE

ENV_SUMMARY = "MOESCOPE_SUMMARY_OUT"


def run_ranks(argv: list[str], world_size: int, timeout_s: float) -> tuple[int, list[dict | None], list[str]]:
    """Run ``moescope <argv>`` as ranks 0..W-1. Returns (exit code, per-rank summaries, per-rank last error).

    The store lives here, so it outlives any rank. If a rank fails, the others get ``timeout_s`` plus a
    grace period to stop on their own (naming the failed rank), then are killed.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    tmp = Path(tempfile.mkdtemp(prefix="moescope-ranks-"))
    run_id = uuid.uuid4().hex[:10] + "-"  # request ids shared by all ranks: <run>-<index>
    procs, logs = [], []
    for r in range(world_size):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
               "MOESCOPE_RUN_ID": run_id,
               ENV_STORE: f"127.0.0.1:{store.port}", ENV_SUMMARY: str(tmp / f"rank{r}.json")}
        log = open(tmp / f"rank{r}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "moescope", *argv], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    first_failure = None
    try:
        while any(p.poll() is None for p in procs):
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
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
        for log in logs:
            log.close()
    summaries, errors = [], []
    for r, p in enumerate(procs):
        path = tmp / f"rank{r}.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
        lines = [ln for ln in (tmp / f"rank{r}.log").read_text(errors="replace").splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if ln.startswith("moescope: error:")), None)
        if p.returncode != 0 and err is None:
            err = f"rank {r} exited with code {p.returncode}" + (f": {lines[-1]}" if lines else "")
        errors.append(err or "")
    code = max((p.returncode for p in procs), key=lambda c: (c != 0, abs(c)))
    return (code if code > 0 else (1 if code else 0)), summaries, errors
