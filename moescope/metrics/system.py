"""Process and GPU memory: ``rss_bytes`` for the trace writer's steps, the same reading the exporter serves as
``moescope_process_resident_memory_bytes`` (prometheus_client's ``ProcessCollector``: ``/proc/self/stat``'s rss
field x the page size); ``gpu_memory`` read by the exporter at scrape time. No GPU or no NVML means no GPU series,
never an error."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("moescope.metrics")
_nvml_state: dict[str, object] = {}


def rss_bytes() -> int | None:
    """Resident set size of this process, or None where there is no ``/proc`` (not Linux).

    ``ProcessCollector``'s formula, read directly: the trace writer reads it every 100 ms, and the collector's
    ``collect()`` also reads the process' limits and lists its open file descriptors each time (profiled at
    deepseek-v3-shape, one client: 0.6% of the server's CPU went to that)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[21]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class GpuMemory:
    index: int
    uuid: str
    used: int
    total: int


def gpu_memory() -> list[GpuMemory]:
    """Memory of every NVML device (NVML ignores CUDA_VISIBLE_DEVICES: series carry the UUID to join on)."""
    if _nvml_state.get("failed"):
        return []
    try:
        import pynvml  # optional: pynvml (the gpu extra)

        if not _nvml_state.get("init"):
            pynvml.nvmlInit()
            _nvml_state["init"] = True
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuMemory(i, uuid.decode() if isinstance(uuid, bytes) else uuid, int(mem.used),
                                 int(mem.total)))
        return out
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors: degrade to no series
        _nvml_state["failed"] = True
        log.info("no GPU memory metrics: %s", exc)
        return []
