"""Process and GPU memory: ``rss_bytes`` for the trace writer's steps, read by the same prometheus_client
``ProcessCollector`` the exporter serves ``moescope_process_resident_memory_bytes`` from (one reading of the
process, not two); ``gpu_memory`` read by the exporter at scrape time. No GPU or no NVML means no GPU series,
never an error."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("moescope.metrics")
_nvml_state: dict[str, object] = {}
_process: list = []  # the ProcessCollector, made on first use


def rss_bytes() -> int | None:
    """Resident set size of this process as the exporter reports it, or None where the collector has no reading
    (not Linux) or prometheus-client (the ``metrics`` extra) is not installed."""
    if not _process:
        try:
            from prometheus_client import ProcessCollector  # the optional extra: imported where it is used
        except ImportError:
            _process.append(None)
        else:
            _process.append(ProcessCollector(registry=None))  # reads /proc for this process (families process_*)
    if _process[0] is None:
        return None
    for family in _process[0].collect():
        if family.name == "process_resident_memory_bytes":
            return int(family.samples[0].value)
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
        import pynvml

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
