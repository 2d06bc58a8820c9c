"""A real vLLM OpenAI server (the CPU build in ``.vllm``) for tests, sized for a shared 2-core, 24 GiB machine.

    with VLLMServer(model_dir, port) as server:        # waits for /health (240 s), else raises with the log tail
        server.url          # http://127.0.0.1:PORT  (OpenAI API under server.url + "/v1")
        server.log_path     # the server's stdout+stderr
        server.name         # --served-model-name (default: the folder's name)
    # at exit: SIGTERM to the server's whole process group, SIGKILL after 20 s

``args`` are appended to the command line (later flags win over the defaults below), e.g.
``["--no-enable-prefix-caching"]`` or ``["--tensor-parallel-size", "2"]`` (with
``env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}``); ``env_extra`` is merged over the defaults.
``vllm_available()`` says whether the ``.vllm`` environment is there.

Defaults (measured to work on the CPU build, vllm-cpu 0.32.0): ``--dtype float32`` (on an AVX2-only CPU
  bfloat16 also serves, but oneDNN falls back to torch linear and it decodes ~40% slower; MLA models:
``mla_args``), ``--max-model-len 1024``, ``--max-num-seqs 16``, ``--gpu-memory-utilization 0.3`` (on CPU: the
share of RAM reserved),
``--enforce-eager`` (skips the torch.compile warm-up: engine init ~3 s instead of ~60-70 s on a cold compile
cache; pass ``--no-enforce-eager`` to compile), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), offline (HF_HUB_OFFLINE,
TRANSFORMERS_OFFLINE), no usage stats. DeepSeek-V3 (MLA) on CPU: vLLM itself turns prefix caching and chunked
prefill off ("MLA is enabled on a non-GPU platform"). Start-up measured on a contended 2-core machine (other
servers running, load average ~12): 60-128 s (REFERENCE.md measured ~27 s on a quiet one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("MOESCOPE_VLLM_PYTHON") or ROOT / ".vllm" / "bin" / "python")
# The older release beside it (``make vllm-env`` builds .vllm031/, vllm-cpu 0.31.0): the count and trace test runs on
# it too, in the same pass (tests/test_vllm.py).
VLLM_PYTHON_PREVIOUS = Path(os.environ.get("MOESCOPE_VLLM_PYTHON_PREVIOUS") or ROOT / ".vllm031" / "bin" / "python")

DEFAULT_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
                "--gpu-memory-utilization", "0.3", "--enforce-eager"]
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def mla_args(model_dir: Path) -> list[str]:
    """An MLA model (DeepSeek-V3-style: ``kv_lora_rank`` in its config) is served with vLLM's reference CPU MLA
    backend. On a CPU with AMX tiles (Sapphire Rapids and later) vLLM picks its AMX MLA backend instead, which
    refuses float32 weights at load ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8": seen on
    such a machine here); on an AVX2-only CPU CPU_MLA is vLLM's own choice, so the flag changes nothing there."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return ["--attention-backend", "CPU_MLA"] if config.get("kv_lora_rank") else []


def _free_port() -> int:
    from servers import free_port  # the suite's port allocator (never two servers on one port in a run)

    return free_port()


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


class VLLMServer:
    def __init__(self, model_dir: str | os.PathLike, port: int, env_extra: dict[str, str] | None = None,
                 args: list[str] | None = None, *, name: str | None = None, host: str = "127.0.0.1",
                 timeout: float = 240.0, log_path: str | os.PathLike | None = None,
                 python: str | os.PathLike = VLLM_PYTHON) -> None:
        self.model_dir = Path(model_dir)
        self.port = port
        self.host = host
        self.name = name or self.model_dir.name
        self.url = f"http://{host}:{port}"
        self.timeout = timeout
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkdtemp(prefix="vllm-server-")) / f"vllm-{port}.log"
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                    "--port", str(port), "--host", host, "--served-model-name", self.name,
                    *DEFAULT_ARGS, *mla_args(self.model_dir), *(args or [])]
        self.env = {**os.environ, **DEFAULT_ENV, **(env_extra or {})}
        self.proc: subprocess.Popen | None = None
        self.load_seconds: float | None = None

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMServer:
        if self.alive:  # already started (start() then ``with``)
            return self
        if not Path(self.cmd[0]).exists():
            raise FileNotFoundError(f"{self.cmd[0]} missing: the vLLM CPU environment is not installed")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.load_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} before it was healthy "
                                   f"({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not healthy within {self.timeout:.0f} s ({self.log_path}):\n"
                           f"{self.log_tail()}")

    def stop(self, grace: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the whole group: engine core and worker processes too
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The leader (API server) can exit before its engine core and workers finish their own shutdown (vLLM's
        # worker exits after it sees its parent go, then runs its exit handlers: moescope's trace writer commits
        # there). Give the rest of the group the grace to leave, then kill what is left.
        deadline = time.monotonic() + grace
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def client(self, **kw):
        """An ``openai.OpenAI`` client for this server (the openai package must be importable)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", **kw)


def serve(model_dir: Path, env: dict[str, str], args=(), *, eager: bool = False, dtype: str = "float32",
          python: str | os.PathLike = VLLM_PYTHON):
    """A real vLLM server of ``model_dir`` with exactly the ``MOESCOPE_*`` variables in ``env`` (the test process'
    own, such as conftest's trace store, are not passed on); compiled (vLLM's default) unless ``eager``; float32,
    as the HF reference computes; from the vLLM environment of ``python``."""
    server = VLLMServer(model_dir, _free_port(), env_extra=env,
                        args=["--dtype", dtype, "--enforce-eager" if eager else "--no-enforce-eager", *args],
                        name="tiny", python=python)
    server.env = {k: v for k, v in server.env.items() if not k.startswith("MOESCOPE_") or k in env}
    return server


def log_text(server) -> str:
    return server.log_path.read_text(errors="replace")
