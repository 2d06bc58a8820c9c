"""The plugin's assembly, in each vLLM process where a model runner executes: settings from the environment,
the one wrap of the model runner's ``execute_model`` (vLLM has no per-step hook for plugins), and on a runner's
first step the adapter attached through ``moescope.instrument`` (the same assembly point as ``moescope demo``).

Never harm vLLM: a bad setting, an unsupported vLLM, a model without MoE layers, a port already taken, a store
that cannot be opened: each is one log line (``moescope.vllm``) and moescope stays off in that worker; an error
on the step path is counted (``errors``), logged once, and never raised into vLLM.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moescope.capture.sources import Reading
from moescope.config import Config, ConfigError, DEFAULT_WINDOW_S, Metrics, Traces

log = logging.getLogger("vllm.moescope")  # under vLLM's logger: its handlers and format, in its log

# The vLLM releases this plugin was run against (its tests build these): another release is refused with one
# line naming it, and vLLM serves as usual. MOESCOPE_VLLM_ANY_VERSION=1 tries anyway.
SUPPORTED = ("0.31.", "0.32.", "0.33.")
DEFAULT_TRACE_SAMPLE = 0.1


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    """The plugin's configuration, read from ``MOESCOPE_*`` environment variables (docs/vllm.md)."""

    port: int | None = None
    addr: str = "127.0.0.1"
    traces: str | None = None
    sample: float = DEFAULT_TRACE_SAMPLE
    model_name: str | None = None
    baseline: str | None = None
    window_s: float = DEFAULT_WINDOW_S
    hot_reference: str = "learned"

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env

        def number(name, kind, default):
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None

        port = number("MOESCOPE_METRICS_PORT", int, None)
        if port is not None and not 0 < port <= 65535:  # (0, "any free port", would be one no scraper knows)
            raise SettingsError(f"MOESCOPE_METRICS_PORT must be 1..65535, got {port}")
        baseline = env.get("MOESCOPE_BASELINE") or None
        if baseline is not None and not Path(baseline).is_file():
            raise SettingsError(f"MOESCOPE_BASELINE={baseline!r}: no such file")
        settings = cls(port=port, addr=env.get("MOESCOPE_METRICS_ADDR") or "127.0.0.1",
                       traces=env.get("MOESCOPE_TRACES") or None,
                       sample=number("MOESCOPE_TRACE_SAMPLE", float, DEFAULT_TRACE_SAMPLE),
                       model_name=env.get("MOESCOPE_MODEL_NAME") or None, baseline=baseline,
                       window_s=number("MOESCOPE_WINDOW_S", float, DEFAULT_WINDOW_S),
                       hot_reference=(env.get("MOESCOPE_HOT_REFERENCE") or "learned").strip())
        settings.config(rank=0)  # the checks and defaults are moescope.config's, as for the CLI
        return settings

    def config(self, rank: int, model_name: str | None = None):
        """The ``moescope.Config`` of data-parallel rank ``rank``'s worker: its exporter on port + rank, its traces
        at the rank's path (``moescope.config.Traces.for_rank``). Raises ``SettingsError`` naming the variable."""
        where = {"metrics port": "MOESCOPE_METRICS_PORT", "metrics window": "MOESCOPE_WINDOW_S",
                 "hot reference": "MOESCOPE_HOT_REFERENCE", "trace sample": "MOESCOPE_TRACE_SAMPLE"}
        try:
            traces = Traces(self.traces, sample=self.sample).for_rank(rank) if self.traces else None
            metrics = Metrics(port=None if self.port is None else self.port + rank, addr=self.addr,
                              model_name=self.model_name or model_name, rank=rank, window_s=self.window_s,
                              baseline=self.baseline, hot_reference=self.hot_reference)
        except ConfigError as e:
            name = next((var for key, var in where.items() if str(e).startswith(key)), "MOESCOPE_*")
            raise SettingsError(f"{name}: {e}") from None
        return Config(metrics=metrics, traces=traces)


_installed = False
_lock = threading.Lock()


def install() -> bool:
    """Wrap the model runner's ``execute_model`` once per process; False (and one log line) where moescope
    stays off."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            Settings.from_env()
        except SettingsError as e:
            log.warning("moescope: off: %s", e)
            return False
        try:
            import vllm  # optional: vllm (only inside a vLLM process)
        except Exception as e:  # noqa: BLE001 (an import that fails for any reason leaves vLLM as it is)
            log.warning("moescope: off: cannot import vLLM (%s: %s)", type(e).__name__, e)
            return False
        version = getattr(vllm, "__version__", "?")
        if not version.startswith(SUPPORTED) and os.environ.get("MOESCOPE_VLLM_ANY_VERSION") != "1":
            log.warning("moescope: off: vLLM %s is not a supported version (%s; MOESCOPE_VLLM_ANY_VERSION=1 "
                        "tries anyway)", version, ", ".join(v + "x" for v in SUPPORTED))
            return False
        runners = _runner_classes(RUNNERS)
        if not runners:
            log.warning("moescope: off: none of vLLM's model runner classes could be imported (%s)",
                        ", ".join(f"{m}.{c}" for m, c in RUNNERS))
            return False
        # A graph compiled with moescope's capture (a copy into its step buffer) never serves a process without
        # it, nor the reverse: vLLM's compile cache is off here and in the processes this one starts.
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        try:
            from moescope.vllm import capture  # start-up: numpy, torch (vllm.capture), only when install() runs

            capture.install_hook()
        except Exception as e:  # noqa: BLE001
            log.warning("moescope: off: cannot watch vLLM's MoE layers (%s)", _one_line(e))
            return False
        for cls in runners:
            _wrap_execute_model(cls)
        _wrap_load_model()
        _installed = True
        return True


# The model runners whose execute_model the plugin wraps: vLLM's V1 runner and Model Runner V2 (the default on
# every GPU build with Triton: ``VllmConfig.use_v2_model_runner``). The CPU build's runners subclass these.
RUNNERS = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
           ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"))


def _runner_classes(names) -> list[Any]:
    """vLLM's model runner classes of this build, of ``names`` ((module, class)); vLLM's types, untyped here."""
    out = []
    for module, name in names:
        try:
            out.append(getattr(__import__(module, fromlist=[name]), name))
        except Exception as e:  # noqa: BLE001 (a runner this build or release does not have)
            log.debug("moescope: no %s.%s (%s)", module, name, _one_line(e))
    return out


def _wrap_execute_model(cls) -> None:
    """Wrap ``cls.execute_model`` once: the step's start and end around vLLM's own (dummy runs pass through)."""
    original = cls.__dict__.get("execute_model")
    if original is None or getattr(original, "_moescope", False):
        return

    def execute_model(self, scheduler_output, *args, **kwargs):
        worker = None if kwargs.get("dummy_run") else _worker(self)
        if worker is None or worker.adapter.paused:  # (paused: the capture switch has capture off)
            return original(self, scheduler_output, *args, **kwargs)
        worker.before(self, scheduler_output)
        t0 = time.perf_counter()
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            worker.after(self, scheduler_output, t0)

    cls.execute_model = _marked(execute_model, original)


def _marked(wrapper, original):
    """``wrapper`` marked as moescope's (so it is wrapped once) over ``original``."""
    wrapper.__dict__.update(_moescope=True, __wrapped__=original)
    return wrapper


_OFF = object()


def _wrap_load_model() -> None:
    """Set up right after a runner loads its model (so the exporter serves from start-up, before any request),
    for the model runner classes of this build (the V1 CPU runner loads its own way)."""
    classes = _runner_classes((*RUNNERS, ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")))
    for cls in classes:
        original = cls.__dict__.get("load_model")
        if original is None or getattr(original, "_moescope", False):
            continue

        def load_model(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            _worker(self)  # never raises: a failure is one log line and moescope stays off here
            return out

        cls.load_model = _marked(load_model, original)


def _worker(runner):
    """The runner's moescope state, set up on its first step (after vLLM's start-up forwards); None when off."""
    state = runner.__dict__.get("_moescope")
    if state is None:
        state = runner.__dict__["_moescope"] = _start(runner) or _OFF
    return None if state is _OFF else state


class Worker:
    """One model runner's instrumentation: the adapter, the instrumentation it feeds, the error count, and what
    moescope cost the step path (``cost_s``: host time in ``before``/``after``; ``step_s``: the forward's own,
    vLLM's ``execute_model``): exported as ``moescope_capture_seconds_total`` beside the step time. It reports its
    cost and errors as a source on the instrumentation's metrics (``capture.sources``: read once per evaluation, off
    vLLM's step thread)."""

    def __init__(self, adapter, inst) -> None:
        self.adapter = adapter
        self.inst = inst
        self.errors = 0
        self.cost_s = 0.0
        self.step_s = 0.0
        inst.metrics.sources.register(self)

    def read(self) -> Reading:
        """The step path's cost so far and the step hooks' errors (``vllm_step``)."""
        return Reading(cost_s=self.cost_s, errors={"vllm_step": self.errors} if self.errors else {})

    def _failed(self, where: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("moescope: %s failed (counted; vLLM goes on; further errors at debug)", where)
        else:
            log.debug("moescope: %s failed", where, exc_info=True)

    def before(self, runner, scheduler_output) -> None:
        t0 = time.perf_counter()
        try:
            self.adapter.begin_step(scheduler_output, output_tokens(runner))
        except Exception:
            self.adapter._rows = 0
            self._failed("step start")
        self.cost_s += time.perf_counter() - t0

    def after(self, runner, scheduler_output, forward_t0: float) -> None:
        t0 = time.perf_counter()
        self.step_s += t0 - forward_t0
        try:
            self.adapter.end_step(scheduler_output, row_order(runner, scheduler_output))
        except Exception:
            self._failed("step end")
        self.cost_s += time.perf_counter() - t0


# -- what is read of a model runner (the rest comes from the scheduler's output) --------------------------------
def row_order(runner, scheduler_output) -> list:
    """The engine request ids in the order of the batch's rows, after ``execute_model``: Model Runner V2 keeps the
    batch it ran in ``execute_model_state.input_batch`` (until ``sample_tokens``), else orders the scheduled
    requests with its own ``sort_batch_req_ids`` (what ``gather_batch_req_state`` calls); the V1 runner keeps
    ``input_batch``."""
    batch = getattr(getattr(runner, "execute_model_state", None), "input_batch", None)
    if batch is None and hasattr(runner, "req_states"):  # Model Runner V2 without its state (seen on a first step)
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids  # optional: vllm (only inside a vLLM process)

        return sort_batch_req_ids(scheduler_output.num_scheduled_tokens,
                                  scheduler_output.scheduled_spec_decode_tokens, runner.decode_query_len)
    if batch is None:
        batch = runner.input_batch
    return list(batch.req_ids)


def output_tokens(runner):
    """A reader of a finished request's generated token ids, ``read(engine_id, n)``, where the runner holds them in
    host memory before it frees the request (None: unknown, the trace keeps routing and prompt only):
    V1: ``requests[id].output_token_ids``; Model Runner V2: its token table ``req_states.all_token_ids``, where
    that lives in host memory (UVA, the default, or the CPU build); never a device read (a host sync)."""
    requests = getattr(runner, "requests", None)
    if isinstance(requests, dict):
        def v1(engine_id, n):
            state = requests.get(engine_id)
            return list(getattr(state, "output_token_ids", ()) or ())[:n] if state is not None else ()
        return v1
    states: Any = getattr(runner, "req_states", None)  # vLLM's RequestState (set wherever ``table`` is)
    table = getattr(states, "all_token_ids", None)
    host = getattr(getattr(table, "_uva_buf", None), "np", None)
    if host is None and table is not None and getattr(table.gpu, "device", None) is not None \
            and table.gpu.device.type == "cpu":
        host = table.gpu.numpy()
    if host is None:
        return None

    def v2(engine_id, n):
        idx = states.req_id_to_index.get(engine_id)
        if idx is None:
            return ()
        start = int(states.prompt_len.np[idx])
        return host[idx, start:start + n].tolist()
    return v2


def _ranks(vllm_config) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of this worker."""
    tp_rank = 0
    try:
        from vllm.distributed import parallel_state  # optional: vllm (only inside a vLLM process)

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 (no distributed state: a single process)
        tp_rank = 0
    return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0), int(tp_rank)


def _served_name(vllm_config) -> str | None:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name or getattr(vllm_config.model_config, "model", None)


def on_exit(close) -> None:
    """Runs ``close`` when this process leaves cleanly. vLLM's workers are multiprocessing children: spawned ones
    (the CPU build, CUDA once initialised) run atexit handlers, forked ones (vLLM's default start method elsewhere)
    leave through ``os._exit`` and run only multiprocessing's exit finalizers. Both are registered; ``close`` runs
    once. A kill (vLLM's default ``--shutdown-timeout 0`` ends its workers so) runs neither: the trace writer's last
    flush interval is lost, as in any crash."""
    pending = [close]

    def once() -> None:
        while pending:
            pending.pop()()

    atexit.register(once)
    multiprocessing.util.Finalize(None, once, exitpriority=100)


def _start(runner):
    """Attach to a runner's model: one log line either way."""
    try:
        settings = Settings.from_env()
        vllm_config = runner.vllm_config
        dp_rank, tp_rank = _ranks(vllm_config)
        if tp_rank != 0:
            # Tensor-parallel ranks route the same tokens as their rank 0: counting them too would count every token
            # tp times (vLLM issue 22167's trap). Rank 0 of each data-parallel rank reports its tokens.
            log.info("moescope: tensor-parallel rank %d routes the tokens rank 0 reports: not exported", tp_rank)
            return None
        # start-up: numpy, torch (api, vllm.vllm_adapter), only when _start() runs
        from moescope.api import instrument
        from moescope.vllm.vllm_adapter import VLLMAdapter, attention_shape

        served = _served_name(vllm_config)
        tokenizer = _tokenizer(vllm_config) if settings.traces else None
        adapter = VLLMAdapter(runner.get_model(), served_name=served, tokenizer=tokenizer,
                              attention=attention_shape(vllm_config.model_config.hf_text_config))
        config = settings.config(dp_rank, served)
        port, traces = config.metrics.port, config.traces
        inst = instrument(adapter, config)
    except Exception as e:  # noqa: BLE001 (whatever it is, vLLM serves on without moescope)
        log.warning("moescope: off in this worker: %s", _one_line(e))
        return None
    _watch_eplb(runner, inst)
    worker = Worker(adapter, inst)  # its cost and errors: a source on the metrics (the adapter registered its drops)
    on_exit(inst.close)  # the worker's exit: the trace writer commits what it holds, the exporter stops
    # vLLM's step carries none of moescope's summarising: the instrumentation's evaluator summarises on its own
    # thread, once per interval (an idle server's last steps too: vLLM never reports going idle)
    log.info("moescope: watching %d MoE layers x %d experts (top-%d) of %s, rank %d%s%s", len(adapter.runners),
             adapter.n_experts, adapter.top_k, served, dp_rank,
             f"; metrics on {settings.addr}:{port}" if port is not None else "",
             f"; traces to {traces.path} (sample {traces.sample})" if traces is not None else "")
    return worker


def _watch_eplb(runner, inst) -> None:
    """vLLM's own EPLB placement, where it runs EPLB: the per-rank load and the step-level prediction of the placement
    in use read it (``vllm.eplb_state``: the maps copied only after vLLM's host state says they changed). Without
    EPLB the reader finds no state and reports none. A failure here is one log line: the rest of moescope runs."""
    try:
        from moescope.vllm.eplb_state import VllmEplbReader  # start-up: numpy (only when the plugin starts)

        info = inst.metrics.info
        reader = VllmEplbReader(lambda: runner, info.moe_layers, info.n_experts)
        inst.metrics.sources.register(reader)
        inst.metrics.step_balance.in_use_source = reader.layout
    except Exception as e:  # noqa: BLE001 (vLLM serves on; moescope without its EPLB view)
        log.warning("moescope: vLLM's EPLB placement is not read: %s", _one_line(e))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _tokenizer(vllm_config):
    """The model's tokenizer, for the trace's text (None: the trace keeps token ids only)."""
    try:
        from transformers import AutoTokenizer  # optional: transformers (the hf extra)

        mc = vllm_config.model_config
        return AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=bool(mc.trust_remote_code))
    except Exception as e:  # noqa: BLE001
        log.info("moescope: no tokenizer for trace text (%s)", _one_line(e))
        return None
