"""``moescope plan-placement``: a balanced expert placement (with replicas of hot experts) from recorded load."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moescope.cli.requests_cmd import TRACES_OPTION, parse_since

IMPORT_OPTION = click.option("--import", "import_path", type=click.Path(dir_okay=False), default=None,
                             help="Read load from an SGLang expert-distribution dump (.pt) or a Megatron-style "
                                  "tokens-per-expert JSONL instead of the trace store.")


@click.command("plan-placement")
@TRACES_OPTION
@IMPORT_OPTION
@click.option("--since", default=None, help="Trace store: only requests since (30s, 5m, 2h, 1d, ISO).")
@click.option("--ranks", type=click.IntRange(min=1), required=True, help="Expert-parallel ranks.")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Physical expert slots per rank [ceil(E / ranks)]; more slots replicate hot experts.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="placement", show_default=True,
              help="Directory for eplb.json (deepseek-ai/EPLB tensors) and placement.yaml (`demo --placement`).")
@click.option("--json", "as_json", is_flag=True, help="Print the prediction as JSON.")
def plan_cmd(traces_path, import_path, since, ranks, slots, out_dir, as_json) -> int:
    """Plan which rank holds which experts; predict max/mean load per rank against round-robin."""
    from moescope.analysis import placement_plan, profile

    prof = profile.load(traces_path, import_path, since=parse_since(since) if since else None)
    plan = placement_plan.plan(prof, ranks, slots)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eplb.json").write_text(json.dumps(plan.eplb()) + "\n")
    (out / "placement.yaml").write_text(plan.placement_yaml(prof.n_experts))
    summary = {"source": prof.source, "ranks": ranks, "slots_per_rank": plan.slots, "n_experts": prof.n_experts,
               "layers": {str(k): v for k, v in plan.predicted.items()},
               "files": [str(out / "eplb.json"), str(out / "placement.yaml")]}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return 0
    click.echo(f"placement for {ranks} ranks x {plan.slots} slots from {prof.source} ({prof.n_experts} experts)")
    click.echo(f"{'layer':>5}  {'max/mean planned':>16}  {'round-robin':>11}  {'cross-rank planned':>18}  "
               f"{'round-robin':>11}")
    for layer, p in plan.predicted.items():
        click.echo(f"{layer:>5}  {p['planned_max_over_mean']:>16.3f}  {p['round_robin_max_over_mean']:>11.3f}  "
                   f"{p['planned_cross_rank_share']:>18.1%}  {p['round_robin_cross_rank_share']:>11.1%}")
    click.echo(f"wrote {out / 'eplb.json'} and {out / 'placement.yaml'} "
               f"(use: moescope demo --world-size {ranks} --placement {out / 'placement.yaml'})")
    return 0
