"""``moescope check determinism``: exit 1 when routing is not reproducible."""

from __future__ import annotations

from dataclasses import asdict

import click

from moescope.cli.config_options import ModelSource, model_source_options
from moescope.cli.options import echo, emit_json, json_option
from moescope.errors import CheckFailed


@click.group("check")
def check() -> None:
    """Checks to run before going live (exit 1 when they find a problem)."""


def _flip_rates(report) -> str:
    return ", ".join(f"L{k} {v:.2%}" for k, v in report.flip_rate.items())


def _verdict(report, threshold: float, passed: bool) -> str:
    return "PASS" if passed else f"FAIL: flip rate {report.worst:.2%} > threshold {threshold:.2%}"


@check.command("determinism")
@model_source_options
@click.option("--scenario", default="healthy", show_default=True, help="Fault scenario(s) to check under.")
@click.option("--runs", type=click.IntRange(min=2), default=5, show_default=True)
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=8, show_default=True,
              help="Held-out prompts of every domain to route.")
@click.option("--threshold", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Largest flip rate per layer that still passes.")
@json_option
def determinism(source: ModelSource, scenario, runs, n_prompts, threshold, as_json) -> None:
    """Route the same inputs RUNS times; report the flip rate per layer and the tokens that flipped."""
    # start-up: torch (analysis.determinism, runtime.faults, runtime.canary), only when the command runs, not for --help
    from moescope.analysis.determinism import check as run_check
    from moescope.runtime import faults
    from moescope.runtime.canary import default_prompts

    model = source.load()
    faults.apply(model, faults.parse(scenario))
    report = run_check(model, default_prompts(n_prompts), runs=runs)
    passed = report.worst <= threshold
    if as_json:
        emit_json({**asdict(report), "threshold": threshold, "passed": passed})
    else:
        echo(f"{report.tokens} tokens x {runs} runs; flip rate per layer: {_flip_rates(report)}")
        for f in report.flipped[:10]:
            echo(f"  run {f['run']} layer {f['layer']} token {f['position']} ({f['text']}): "
                 f"{f['before']} -> {f['after']}")
        echo(_verdict(report, threshold, passed))
    if not passed:
        raise CheckFailed(f"routing is not deterministic: flip rate {report.worst:.2%} > {threshold:.2%}")


@check.command("quantization")
@model_source_options
@click.option("--quantize", "variant", type=click.Choice(["experts", "experts+router"]), default="experts",
              show_default=True, help="What gets int8 weights.")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=32, show_default=True,
              help="Held-out prompts of every domain to route.")
@click.option("--threshold", type=click.FloatRange(min=0), default=0.005, show_default=True,
              help="Largest flip rate per layer that still passes.")
@json_option
def quantization(source: ModelSource, variant, n_prompts, threshold, as_json) -> None:
    """Route the same inputs at full precision and with int8 weights; report flips, non-finite logits and
    output agreement. Exit 1 when a layer's flip rate exceeds the threshold."""
    # start-up: torch (analysis.quantization, runtime.canary), only when the command runs, not for --help
    from moescope.analysis.quantization import compare
    from moescope.runtime.canary import default_prompts

    model = source.load()
    report = compare(model, default_prompts(n_prompts), variant)
    passed = report.worst <= threshold and not any(report.nonfinite_logits.values())
    if as_json:
        emit_json({**asdict(report), "threshold": threshold, "passed": passed})
    else:
        echo(f"int8 {variant}: {report.tokens} tokens; flip rate per layer: {_flip_rates(report)}")
        echo(f"  non-finite router logits: {sum(report.nonfinite_logits.values())}; greedy next token "
             f"unchanged {report.next_token_agreement:.2%}; mean KL {report.mean_kl:.2e} nats")
        echo(_verdict(report, threshold, passed))
    if not passed:
        raise CheckFailed(f"int8 {variant} changes routing: flip rate {report.worst:.2%} > {threshold:.2%}")
