"""What an engine tells its observers after each forward and each finished request: ``StepRecord`` and
``RequestRecord``. They live in the seam, not in an engine, so every engine that reports through it (the reference
runtime, the vLLM adapter) builds the same records and no sink imports an engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    """A finished request: what it asked, what it got, how long each phase took (seconds)."""

    request_id: str
    prompt: str
    output: str
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    arrival: float  # engine clock
    queue_s: float
    prefill_s: float
    ttft_s: float
    token_latencies_s: tuple[float, ...]  # per output token: first = ttft, then gaps between tokens
    total_s: float
    # "length", "eos", "max_seq_len", "stop" (a stop string), "cancelled" (``Engine.cancel``), "timeout"
    # (``timeout_s``) or "error" (its sampling failed, or ``cancel(reason="error")`` after a step failed on it); a
    # request that ends before its first token has ttft_s 0 and no token latencies.
    finish_reason: str
    domain: str | None = None
    tenant: str | None = None
    truncated_prompt: bool = False

    @property
    def n_output(self) -> int:
        return len(self.output_tokens)


@dataclass(frozen=True)
class StepRecord:
    """One forward of the engine. ``segments`` maps the flat batch back to requests:
    (request_id, first position, n tokens) in order."""

    index: int
    phase: str  # "prefill" or "decode"
    started: float
    seconds: float
    n_tokens: int
    segments: tuple[tuple[str, int, int], ...]
    kv_tokens: int = 0  # positions held in the running requests' KV caches after the step (the working set)


__all__ = ["RequestRecord", "StepRecord"]
