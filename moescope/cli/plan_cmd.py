"""``moescope plan-placement``: a balanced expert placement (with replicas of hot experts) from recorded load."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moescope.errors import BadInput
from moescope.cli.options import (echo, emit_json, import_option, json_option, model_option, no_model_with,
                                  since_option, traces_option)
from moescope.progress import progress

@click.command("plan-placement")
@traces_option()
@import_option("Read the load (instead of the trace store) from")
@since_option
@model_option
@click.option("--ranks", type=click.IntRange(min=1), required=True, help="Expert-parallel ranks.")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Physical expert slots per rank [ceil(E / ranks)]; more slots replicate hot experts.")
@click.option("--redundant", type=click.IntRange(min=0), default=None,
              help="EPLB's redundant experts (vLLM's num_redundant_experts) for the step-level verdict [one per rank]; "
                   "experts + redundant must divide over the ranks.")
@click.option("--eplb-window", type=click.IntRange(min=1), default=1000, show_default=True,
              help="EPLB's window_size: steps of load each rearrangement plans from (vLLM's EPLBConfig).")
@click.option("--eplb-interval", type=click.IntRange(min=1), default=3000, show_default=True,
              help="EPLB's step_interval: steps between rearrangements (vLLM's EPLBConfig).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="placement", show_default=True,
              help="Directory for eplb.json (deepseek-ai/EPLB tensors) and placement.yaml (`demo --placement`).")
@json_option
def plan_cmd(traces_path, import_path, since, model, ranks, slots, redundant, eplb_window, eplb_interval, out_dir,
             as_json) -> None:
    """Plan which rank holds which experts; predict max/mean load per rank against round-robin; and, from the
    steps' own routing, whether EPLB on vLLM would pay for its rearrangements at this EP size (the busiest rank per
    step, not the run's average)."""
    # start-up: numpy (analysis.profile, parallel.planner), only when the command runs, not for --help
    from moescope.analysis import ep_advice, profile
    from moescope.parallel import planner as placement_plan
    # start-up: numpy (traces.store), only when the command runs, not for --help
    from moescope.traces.store import CorruptRows

    no_model_with(model, import_path, "--import")
    corrupt = CorruptRows()
    with progress(f"plan-placement: reading the load from {import_path or 'the trace store'}", 1):
        prof = profile.load(traces_path, import_path, since=since, corrupt=corrupt, model=model)
    with progress(f"plan-placement: planning {len(prof.passes)} layers x {prof.n_experts} experts on {ranks} ranks",
                  1):
        plan = placement_plan.plan(prof, ranks, slots)
    if redundant is not None and (prof.n_experts + redundant) % ranks:
        raise BadInput(f"--redundant {redundant}: {prof.n_experts} experts + {redundant} redundant do not divide over "
                       f"{ranks} ranks (vLLM places (experts + redundant) / ranks on each)")
    with progress(f"plan-placement: the busiest rank per step, static vs EPLB at EP {ranks}", 1):
        steps = ep_advice.profile_counts(prof)
        advice = ep_advice.advise(steps, prof.n_experts, ranks, redundant=redundant, window=eplb_window,
                                  interval=eplb_interval, step_s=ep_advice.median_step_s(prof.steps))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eplb.json").write_text(json.dumps(plan.eplb()) + "\n")
    (out / "placement.yaml").write_text(plan.placement_yaml(prof.n_experts))
    summary = {"source": prof.source, "ranks": ranks, "slots_per_rank": plan.slots, "n_experts": prof.n_experts,
               "layers": {str(k): v for k, v in plan.predicted.items()},
               "files": [str(out / "eplb.json"), str(out / "placement.yaml")], "step_level": advice}
    if import_path is None:
        summary["corrupt_rows"] = corrupt.count
    if as_json:
        emit_json(summary)
        return
    echo(f"placement for {ranks} ranks x {plan.slots} slots from {prof.source} ({prof.n_experts} experts)")
    echo(f"{'layer':>5}  {'max/mean planned':>16}  {'round-robin':>11}  {'cross-rank planned':>18}  "
         f"{'round-robin':>11}")
    for layer, p in plan.predicted.items():
        echo(f"{layer:>5}  {p['planned_max_over_mean']:>16.3f}  {p['round_robin_max_over_mean']:>11.3f}  "
             f"{p['planned_cross_rank_share']:>18.1%}  {p['round_robin_cross_rank_share']:>11.1%}")
    echo(f"wrote {out / 'eplb.json'} and {out / 'placement.yaml'} "
         f"(use: moescope demo --world-size {ranks} --placement {out / 'placement.yaml'})")
    if advice is None:
        echo(f"step level: no verdict at EP {ranks} (fewer than 2 steps, or {prof.n_experts} experts do not divide "
             f"over {ranks} ranks)")
        return
    echo(f"step level, {advice['steps_judged']} steps judged after {advice['steps_held_out']} held out to plan EPLB's "
         f"first placement ({advice['slots_per_step_layer']} slots per step and layer):")
    for line in advice["lines"]:
        echo("  " + line)
