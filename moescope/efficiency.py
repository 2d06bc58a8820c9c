"""What routing costs the hardware: the bytes and FLOPs a step implies, and S-MBU / S-MFU (MoE-CAP's sparsity-aware
bandwidth and FLOPs utilisation, arXiv 2412.07067). Pure functions and one table: the metrics state, ``top``,
``diagnose`` and the dashboards read these, never their own formula (docs/metrics.md, "Efficiency").

Terms, per engine step (E experts per MoE layer, L MoE layers, b bytes per parameter at the served dtype):
- weight bytes = b x (dense_params + sum over MoE layers of distinct_l x expert_params): ``distinct_l`` the
  distinct experts the step's tokens were routed to in layer l (measured); ``dense_params`` everything every
  token reads (attention, shared experts, dense FFNs, norms, routers, embeddings and head: the whole embedding
  table is counted, though a step reads only its tokens' rows: an over-estimate of vocab x hidden x b).
- KV bytes = kv_bytes_per_token x sum over the step's requests of their context after the step (every request
  reads its whole cache once per step: attention's K and V of every layer).
- FLOPs = 2 x rows x (dense_params + L x k x expert_params) + attn_flops_per_context x sum over rows of the
  positions the row attends to (causal: row i of a segment starting at p attends p + i + 1).
- S-MBU = (weight bytes + KV bytes) / (step seconds x peak bandwidth);
  S-MFU = FLOPs / (step seconds x peak FLOPs).
Over an interval both are ratio-of-sums (summed bytes over summed step seconds: the time-weighted mean of the
steps'), where MoE-CAP's code averages per decode step with TPOT as the time; here prefill and decode steps are
kept apart by phase, and the peak is the datasheet's dense figure (MoE-CAP's code halves its peak FLOPs and sizes
the activated experts as k experts of one layer in places; neither is done here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moescope.errors import BadInput

# (substring of NVML's device name, peak memory bandwidth bytes/s, peak dense BF16 tensor FLOP/s, source).
# Most specific first: "H100 NVL" and "H100 PCIe" before the SXM part NVML names "H100 80GB HBM3".
# Sources: NVIDIA's datasheets (H100: nvidia.com/en-us/data-center/h100, "H100 SXM / PCIe / NVL" columns;
# H200: nvidia.com/en-us/data-center/h200; A100: the A100 datasheet (40GB and 80GB, SXM and PCIe); L40S and L4:
# their product pages). Dense FLOPs: the datasheets print BF16 "with sparsity"; the dense figure is half of it.
PEAKS: tuple[tuple[str, float, float, str], ...] = (
    ("H100 NVL", 3.9e12, 835e12, "H100 NVL datasheet: 3.9 TB/s, 1,671 TFLOPS BF16 sparse"),
    ("H100 PCIe", 2.0e12, 756e12, "H100 PCIe datasheet: 2 TB/s, 1,513 TFLOPS BF16 sparse"),
    ("H100", 3.35e12, 989e12, "H100 SXM datasheet: 3.35 TB/s, 1,979 TFLOPS BF16 sparse"),
    ("H200 NVL", 4.8e12, 835e12, "H200 NVL datasheet: 4.8 TB/s, 1,671 TFLOPS BF16 sparse"),
    ("H200", 4.8e12, 989e12, "H200 SXM datasheet: 4.8 TB/s, 1,979 TFLOPS BF16 sparse"),
    ("A100-SXM4-80GB", 2.039e12, 312e12, "A100 80GB SXM datasheet: 2,039 GB/s, 312 TFLOPS BF16"),
    ("A100 80GB PCIe", 1.935e12, 312e12, "A100 80GB PCIe datasheet: 1,935 GB/s, 312 TFLOPS BF16"),
    ("A100", 1.555e12, 312e12, "A100 40GB datasheet: 1,555 GB/s, 312 TFLOPS BF16"),
    ("L40S", 864e9, 362e12, "L40S datasheet: 864 GB/s, 733 TFLOPS BF16 sparse"),
    ("L4", 300e9, 121e12, "L4 datasheet: 300 GB/s, 242 TFLOPS BF16 sparse"),
)


@dataclass(frozen=True)
class Peak:
    """The device's peak memory bandwidth (bytes/s) and FLOP/s; either may be None (unknown)."""

    bandwidth: float | None = None
    flops: float | None = None
    source: str = "settings"


def table_peak(device_name: str) -> Peak | None:
    """The table's peak for an NVML device name ("NVIDIA H100 80GB HBM3"), or None for a device it lacks."""
    for key, bw, flops, source in PEAKS:
        if key.lower() in device_name.lower():
            return Peak(bw, flops, source)
    return None


def _positive(value, what: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"{what} must be a number (bytes/s or FLOP/s), got {value!r}") from None
    if not v > 0 or v == float("inf"):
        raise BadInput(f"{what} must be a positive number, got {value!r}")
    return v


def resolve_peak(device: str = "cpu", *, bandwidth=None, flops=None, device_name: str | None = None,
                 env=None) -> Peak | None:
    """The peak S-MBU and S-MFU divide by: settings first (arguments, else ``MOESCOPE_PEAK_BANDWIDTH`` /
    ``MOESCOPE_PEAK_FLOPS``), else the table by the CUDA device's name; on CPU only when given. None: unknown.

    Raises:
        BadInput: a setting that is not a positive number."""
    env = os.environ if env is None else env
    bw = _positive(bandwidth if bandwidth is not None else env.get("MOESCOPE_PEAK_BANDWIDTH"),
                   "the peak bandwidth (--peak-bandwidth, MOESCOPE_PEAK_BANDWIDTH)")
    fl = _positive(flops if flops is not None else env.get("MOESCOPE_PEAK_FLOPS"),
                   "the peak FLOPs (--peak-flops, MOESCOPE_PEAK_FLOPS)")
    table = None
    if str(device).startswith("cuda"):
        if device_name is None:
            try:
                # start-up: torch, only on a CUDA device (the foundations import no heavy package at module level)
                import torch

                device_name = torch.cuda.get_device_name(torch.device(device))
            except Exception:  # noqa: BLE001 - no name, no table entry: the peak stays unknown
                device_name = ""
        table = table_peak(device_name)
    if bw is None and fl is None and table is None:
        return None
    return Peak(bw if bw is not None else (table.bandwidth if table else None),
                fl if fl is not None else (table.flops if table else None),
                "settings" if table is None or (bw is not None and fl is not None) else table.source)


def weight_bytes(dtype_bytes: int, dense_params: int, expert_params: int, distinct_sum: int) -> float:
    """Bytes of weights a step reads: its dense part and every distinct expert it touched (summed over layers)."""
    return float(dtype_bytes) * (dense_params + distinct_sum * expert_params)


def step_flops(rows: int, attended: int, dense_params: int, expert_params: int, n_moe_layers: int, top_k: int,
               attn_flops_per_context: int) -> float:
    """FLOPs of a step: a multiply-add per parameter a row touches (its k experts per MoE layer) and the
    attention over the positions each row attends to."""
    return 2.0 * rows * (dense_params + n_moe_layers * top_k * expert_params) + attn_flops_per_context * attended


def utilisation(amount: float, seconds: float, peak: float | None) -> float | None:
    """amount / (seconds x peak): S-MBU with bytes and peak bandwidth, S-MFU with FLOPs and peak FLOPs. None
    when the peak is unknown or no time passed."""
    if peak is None or not seconds > 0:
        return None
    return amount / (seconds * peak)


def step_activation(dense_params: int, expert_params: int, distinct_sum: int, total_params: int) -> float:
    """The seeds' activation rate of a step: the parameters it touches (dense part and every distinct expert it
    touched) / total parameters."""
    return (dense_params + distinct_sum * expert_params) / total_params


# PromQL of the same quantities over an interval (``window``: a range such as "5m" or Grafana's
# "$__rate_interval"), for the dashboards and `diagnose --prometheus`: ratio-of-sums, as the module docstring says.
def per_step(name: str, matcher: str, by: str = "model, rank", window: str = "$__rate_interval") -> str:
    """A counter's rate summed by ``by`` (a ratio of two is a mean per step, per token)."""
    return f"sum by ({by}) (rate({name}{{{matcher}}}[{window}]))"


def smbu(matcher: str, phase: str = "decode", window: str = "$__rate_interval") -> str:
    """S-MBU: bytes the phase's steps read / their seconds / the device's peak bandwidth; no series where the peak
    is unknown (a CPU without MOESCOPE_PEAK_BANDWIDTH)."""
    m = f'{matcher}, phase="{phase}"'
    return (f"{per_step('moescope_step_read_bytes_total', m, window=window)} / "
            f"{per_step('moescope_step_seconds_sum', m, window=window)} / on (model, rank) "
            f"moescope_peak_bandwidth_bytes_per_second{{{matcher}}}")


def smfu(matcher: str, phase: str = "decode", window: str = "$__rate_interval") -> str:
    """S-MFU: FLOPs of the phase's steps / their seconds / the device's peak FLOP/s (none where unknown)."""
    m = f'{matcher}, phase="{phase}"'
    return (f"{per_step('moescope_step_flops_total', m, window=window)} / "
            f"{per_step('moescope_step_seconds_sum', m, window=window)} / on (model, rank) "
            f"moescope_peak_flops_per_second{{{matcher}}}")
