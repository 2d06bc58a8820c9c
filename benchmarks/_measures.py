"""What each results file measures: the code whose change can change its figures, as git pathspecs (a file, a folder
ending in ``/``, or a ``:(glob)`` pattern), from the repository root.

``benchmarks/_freshness.py`` (run by ``python benchmarks/_doc_tables.py --check``) fails a results file when one of
these paths changed after the commit the file was measured at and nothing re-ran it, unless each change is
behaviour-free (proved by the source's syntax tree, or declared in a commit message; see _freshness.py). A new run
records its list in its provenance (``measures``, benchmarks/_results.py ``save``); the check judges a file against
its own list and this table's, both.

Precise on purpose: a refactor of a view must not stale the serving figures, and a change to the capture path must
stale every figure that times it. A list holds the modules a run executes to make its figures (the benchmark script
and its harness included), not everything it imports: the CLI's option parsing, the docs, the tests that do not
run in the benchmark are left out.
"""

from __future__ import annotations

import fnmatch
from pathlib import PurePosixPath

# The reference runtime's serving path: the bare side of every capture ratio, and every tokens/s figure.
RUNTIME = ("moescope/runtime/engine.py", "moescope/runtime/model.py", "moescope/runtime/router.py",
           "moescope/runtime/experts.py", "moescope/runtime/model_config.py", "moescope/runtime/loader.py",
           "moescope/runtime/weights.py", "moescope/runtime/traffic.py", "moescope/runtime/tokenizer.py",
           "moescope/runtime/routers_cache.py", "moescope/runtime/engine_adapter.py", "moescope/runtime/timing.py",
           "moescope/runtime/canary.py", "moescope/runtime/corpus.py", ":(glob)moescope/assets/*.safetensors")
# What ``moescope.instrument()`` attaches and runs: the hooks on the engine thread, the probe's summary, the window's
# judgement (thresholds, sampling bars), the exporter.
CAPTURE = ("moescope/capture/", "moescope/metrics/", "moescope/api.py", "moescope/__init__.py", "moescope/config.py",
           "moescope/efficiency.py", "moescope/sampling.py", "moescope/stats.py", "moescope/thresholds.py",
           "moescope/judge.py")
# The trace path: the recorder's queue, the writer's thread, the SQLite store and the Parquet lake it can write.
TRACES = ("moescope/traces/recorder.py", "moescope/traces/writer.py", "moescope/traces/store.py",
          "moescope/traces/lake.py", "moescope/traces/sanitize.py")
# The vLLM plugin, and the test harness that builds its checkpoints and starts its servers.
VLLM = ("moescope/vllm/", "tests/vllm_server.py", "tests/vllm_models.py")
# The alerting path of the detection runs: the demo that serves the faults, the rules and routing, the pipeline.
DETECTION = ("benchmarks/detection.py", "tests/pipeline.py", "tests/servers.py", "moescope/alerts/rules.py",
             "moescope/runtime/faults.py", "moescope/cli/demo.py", "moescope/cli/demo_live.py",
             "moescope/analysis/baseline.py", "collectors/alertmanager/", "moescope/traces/store.py")
# Expert parallelism: the ranks' exchange, the launcher, the demo that runs them.
PARALLEL = ("moescope/parallel/", "moescope/cli/demo_parallel.py", "moescope/cli/demo.py")
# The CLI views a run times as subprocesses.
VIEWS = ("moescope/cli/requests_cmd.py", "moescope/cli/trace_cmd.py", "moescope/cli/report_cmd.py",
         "moescope/analysis/report.py", "moescope/traces/store.py")

MEASURES: dict[str, tuple[str, ...]] = {
    "cache-sim.json": ("benchmarks/cache.py", "moescope/analysis/cache_sim.py", "moescope/analysis/cache_stack.py",
                       "moescope/runtime/cache_policy.py"),
    "cache.json": ("benchmarks/cache.py", "moescope/runtime/expert_cache.py", "moescope/runtime/cache_policy.py",
                   *RUNTIME),
    "decode_step-cpu.json": ("benchmarks/decode_step.py", "moescope/runtime/graph_decode.py", *RUNTIME, *CAPTURE),
    "decode_step-cuda.json": ("benchmarks/decode_step.py", "moescope/runtime/graph_decode.py", *RUNTIME, *CAPTURE),
    "router_kernel.json": ("benchmarks/router_kernel.py", "moescope/kernels/", "moescope/runtime/router.py"),
    "detection*.json": (*DETECTION, *RUNTIME, *CAPTURE),
    "detection-matrix.json": ("tests/test_detection_matrix.py", *DETECTION, *RUNTIME, *CAPTURE,
                              "moescope/analysis/diagnose.py", "moescope/cli/diagnose_cmd.py"),
    "efficiency.json": ("benchmarks/efficiency.py", "moescope/analysis/step_experts.py", *RUNTIME, *CAPTURE),
    "efficiency-cost.json": ("benchmarks/efficiency.py", "benchmarks/_verdict.py", *RUNTIME, *CAPTURE),
    "efficiency-vllm.json": ("benchmarks/efficiency.py", "tests/vllm_estimate.py", *VLLM, *CAPTURE, *TRACES),
    "eplb*.json": ("benchmarks/eplb.py", *PARALLEL, *RUNTIME, *CAPTURE),
    "parallel.json": ("benchmarks/parallel.py", *PARALLEL, *RUNTIME, *CAPTURE),
    "step-balance*.json": ("benchmarks/step_balance.py", *PARALLEL, *RUNTIME, "moescope/capture/routing_probe.py",
                           "moescope/metrics/catalogue.py"),
    "fleet_series.json": ("benchmarks/fleet_series.py", *PARALLEL, *CAPTURE),
    "lake.json": ("benchmarks/lake.py", "moescope/traces/to_parquet.py", *TRACES, *VIEWS, *RUNTIME,
                  "moescope/capture/token_trace.py", "moescope/capture/queued.py"),
    "traces.json": ("benchmarks/traces.py", *TRACES, *VIEWS, "moescope/capture/token_trace.py"),
    "mitigate.json": ("benchmarks/mitigate.py", "moescope/runtime/faults.py", *RUNTIME, *CAPTURE),
    "overhead.json": ("benchmarks/overhead.py", *RUNTIME, *CAPTURE, *TRACES),
    "cost*model*.json": ("benchmarks/cost_model.py", "benchmarks/_work.py", *RUNTIME, *CAPTURE, *TRACES,
                        "moescope/hf/", "moescope/vllm/"),
    "runtime.json": ("benchmarks/runtime.py", *RUNTIME),
    "scale.json": ("benchmarks/scale.py", "benchmarks/_scrape.py", "benchmarks/overhead.py", *RUNTIME, *CAPTURE,
                   *TRACES, *VIEWS, "moescope/parallel/"),
    "serve*.json": ("benchmarks/serve.py", "moescope/serve/", "moescope/cli/serve_cmd.py", *RUNTIME, *CAPTURE,
                    *TRACES),
    "vllm.json": ("benchmarks/vllm.py", "benchmarks/_verdict.py", *VLLM, *CAPTURE, *TRACES),
    "vllm-soak.json": ("benchmarks/vllm_soak.py", *VLLM, *CAPTURE, *TRACES),
    # The suite's time: every test, the code they run and the scripts that run them (not the docs pages, though
    # the suite runs their commands: the commit that records this file prints it in docs/design.md).
    "suite-time.json": ("moescope/", "tests/", "benchmarks/", ":(exclude)benchmarks/results/", ".ci/", "Makefile",
                        "pyproject.toml"),
}

# Results files known to be stale: those that cannot be re-run on the machines this project has (what each needs,
# and why it is not there), and those not re-run yet for the time they take (each says which, and how to re-run it).
# The check lets each through only while it IS stale or lacks what it names, and the docs print the notice beside
# its figures (benchmarks/_doc_tables.py ``provenance_line``): never silently.
KNOWN_STALE: dict[str, str] = {
    "decode_step-cuda.json": "needs a CUDA GPU, and none has been lent since (re-run: bash "
                             "benchmarks/device_checks.sh on a lent GPU machine)",
    "router_kernel.json": "needs a CUDA GPU, and none has been lent since (re-run: bash benchmarks/device_checks.sh "
                          "on a lent GPU machine)",
    # Records of a run at their commit, superseded: the docs print each as that run's (its commit beside it), never
    # as what the code does now; not re-run after the capture path's rewrite (issue [lean]).
    "cost_model-before.json": "is the record of the capture path before issue [lean] (commit 6acf7a3), kept beside "
                              "the cost model of the code since: by design never re-run",
    "detection-shapes-hot-learned-first.json": "is the record of the first learned-reference sweep, superseded by "
                                               "detection-shapes-hot-learned.json: not re-run",
    "detection-shapes-hot-learned-second.json": "is the record of the second learned-reference sweep, superseded by "
                                                "detection-shapes-hot-learned.json: not re-run",
    "detection-shapes-hot-learned-third.json": "is the record of the third learned-reference sweep, superseded by "
                                               "detection-shapes-hot-learned.json: not re-run",
    "detection.json": "is the record of the first detection run (before the learned reference, issue [learned]), "
                      "superseded by the learned sweeps; not re-run (about 30 minutes)",
    "detection-shapes-hot.json": "is the record of the hot sweep against 1/E (before the learned reference), "
                                 "superseded by detection-shapes-hot-learned.json; not re-run (about 25 minutes)",
    "detection-shapes-healthy.json": "is the record of the healthy sweep against 1/E (before the learned reference), "
                                     "superseded by detection-shapes-healthy-learned.json; not re-run (about 22 "
                                     "minutes)",
    # Sweeps of detection over shapes no preset names: 12-14 minutes of the whole machine each (three demos at a time)
    # and prose in docs/alerts.md read against each; not re-run after issues [lean] (the evaluator) and [one-bar]
    # (the rules compare with the bar series): the suite's detection matrix (tests/test_detection_matrix.py) runs the
    # alerts on the code of every commit, and detection-matrix.json, detection-collapse-learned.json and
    # detection-shapes-top10-512-window60.json were re-run after them.
    "detection-shapes-hot-learned.json": "is a 14-minute sweep not re-run after issues [lean] and [one-bar] (re-run: "
                                         "its provenance's command)",
    "detection-shapes-healthy-learned.json": "is a 12-minute sweep not re-run after issues [lean] and [one-bar] "
                                             "(re-run: its provenance's command)",
    "detection-shapes-top1-top10.json": "is a 12-minute sweep not re-run after issues [lean] and [one-bar] (re-run: "
                                        "its provenance's command)",
    # Soaks: minutes to half an hour of one machine each; not re-run after issue [lean]'s capture rewrite.
    "serve-soak.json": "is a 5-minute soak not re-run after issue [lean]'s capture rewrite (re-run: python "
                       "benchmarks/serve.py --soak 300)",
    "serve-soak-30min.json": "is a 30-minute soak not re-run after issue [lean]'s capture rewrite (re-run: python "
                             "benchmarks/serve.py --soak 1800 --soak-warmup 120 --soak-clients 8 --soak-variants "
                             "capture_on --out benchmarks/results/serve-soak-30min.json)",
    "serve-load64.json": "is a 5-minute soak at 64 clients not re-run after issue [lean]'s capture rewrite (re-run: "
                         "python benchmarks/serve.py --soak 300 --soak-clients 64 --soak-variants capture_on --out "
                         "benchmarks/results/serve-load64.json)",
    "vllm-soak.json": "is a 30-minute soak of two vLLM servers not re-run after issue [lean]'s capture rewrite "
                      "(re-run: .vllm/bin/python benchmarks/vllm_soak.py --keep-store /tmp/soak-on.sqlite)",
}


# Results files no run of the suite can find fresh: the suite's own time is recorded by a run of `make test` on a
# fresh clone of the commit it times (benchmarks/_suite_time.py), and that same run checks the file, which then
# still holds the run before (every commit since changed what it measures). Judged by the person recording it,
# after the last change (docs/design.md prints its commit beside it); the check lists it, never fails on it.
SELF_MEASURED: dict[str, str] = {
    "suite-time.json": "the suite's own time: the run that records it is the run that checks it",
}


def _pattern(key: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, key)


def of(results: str) -> tuple[str, ...] | None:
    """The pathspecs ``results`` (a results file's name or path; a ``--quick`` run's ``X-quick.json`` is X's)
    measures: its exact entry, else the longest matching pattern; None where the table has none."""
    name = PurePosixPath(str(results)).name.replace("-quick.json", ".json")
    if name in MEASURES:
        return MEASURES[name]
    keys = sorted((k for k in MEASURES if "*" in k and _pattern(k, name)), key=len, reverse=True)
    return MEASURES[keys[0]] if keys else None
