"""The docs' tables of the CPU benchmarks whose scripts print none of their own, printed from their results files
(json only: no torch, so `benchmarks/_doc_tables.py --check` stays quick):

    python benchmarks/_tables.py --markdown benchmarks/results/overhead.json
    python benchmarks/_tables.py --markdown benchmarks/results/runtime.json --section hf|grouped|serving
    python benchmarks/_tables.py --markdown benchmarks/results/parallel.json
    python benchmarks/_tables.py --markdown benchmarks/results/cache.json
    python benchmarks/_tables.py --markdown benchmarks/results/cache-sim.json
    python benchmarks/_tables.py --markdown benchmarks/results/mitigate.json --section load-aware|smoothing
    python benchmarks/_tables.py --markdown benchmarks/results/traces.json
    python benchmarks/_tables.py --markdown benchmarks/results/detection-matrix.json --section tiny-demo|shape
    python benchmarks/_tables.py --markdown benchmarks/results/serve-soak.json      (any soak file of serve.py)
    python benchmarks/_tables.py --markdown benchmarks/results/scale.json
    python benchmarks/_tables.py --markdown moescope/assets/tiny-demo.json          (the demo model's routing)

(benchmarks/_doc_tables.py keeps the docs' blocks equal to what these print, with the file's provenance under
each.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _verdict import quartiles, verdict


def _pct(x: float) -> str:
    return f"{x:.1%}"


# issue [lean]: capture's goal, capture on / off in one process, at 16 concurrent requests; rows at other
# concurrencies are measured against no goal
OVERHEAD_GOALS = {"metrics": 1.01, "metrics+traces": 1.03}
OVERHEAD_GOAL_CONCURRENCY = 16


def _overhead_verdict(w: dict, name: str) -> str:
    if w["concurrency"] != OVERHEAD_GOAL_CONCURRENCY:
        return "-"
    return verdict(w[name].get("ratios"), OVERHEAD_GOALS[name], why="this file keeps no per-round ratios")


OVERHEAD_VARIANTS = ("metrics", "metrics+traces")  # benchmarks/overhead.py's VARIANTS (this module imports no torch)


def overhead_bound(v: dict) -> list[float] | None:
    """Per interleaved round, an upper bound of capture's cost: the round's ratio of decode steps on / off (the
    engine's thread's own work and about half of what the background threads cost it) plus the background threads'
    whole CPU share (what they could cost it at most: they run on another core, and the engine waits on them only
    for the interpreter's lock)."""
    il = v.get("interleaved")
    if not il:
        return None
    return [x + v["background_cpu_share"] for x in il["ratios"]]


def _bound_verdict(w: dict, name: str) -> str:
    if w["concurrency"] != OVERHEAD_GOAL_CONCURRENCY:
        return "-"
    return verdict(overhead_bound(w[name]), OVERHEAD_GOALS[name], why="this file has no interleaved rounds")


def _q(x: dict, key: str = "ratios") -> str:
    q = quartiles(x[key])
    return f"{q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f})"


def overhead(d: dict, section: str | None) -> list[str]:
    lines = [f"torch {d['torch']}, {d['threads']} intra-op thread(s); rounds of each kind (each row's "
             "count in its results file), in one process with the capture switch; medians (quartiles) of the "
             "per-round ratios. Passes: the whole "
             "workload with capture off, then on (or on, then off); A/A: two passes both off (the machine's own "
             "noise between passes); interleaved: one run, capture flipped every "
             f"{d['workloads'][0][OVERHEAD_VARIANTS[0]].get('interleaved', {}).get('block_steps', '-')} steps, "
             "decode steps "
             "on / off. Goal (issue [lean], at "
             f"{OVERHEAD_GOAL_CONCURRENCY} concurrent requests): metrics <= {OVERHEAD_GOALS['metrics']}x, metrics + "
             f"traces <= {OVERHEAD_GOALS['metrics+traces']}x, judged by benchmarks/_verdict.py (met only where the "
             "upper quartile of the per-round figures is within the goal) on the passes, and on the interleaved "
             "rounds plus the background threads' whole CPU share (an upper bound of the cost):", "",
             "| workload | concurrent requests | requests x tokens | variant | capture off s | passes on / off | A/A "
             "passes | interleaved steps on / off | background CPU share | GC share on | goal: passes | goal: "
             "interleaved + background |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for w in d["workloads"]:
        per_side = f" (served {w['repeat']}x a side)" if w.get("repeat", 1) > 1 else ""
        for name in OVERHEAD_VARIANTS:
            v = w[name]
            il = v.get("interleaved")
            lines.append(f"| {w['model']} | {w['concurrency']} | {w['requests']} x {w['output_tokens']}{per_side} | "
                         f"{name} | {v['off_s']:.3f} | {_q(v)} | {_q(v, 'a_a_ratios') if 'a_a_ratios' in v else '-'} "
                         f"| {_q(il) if il else '-'} | {v.get('background_cpu_share', 0):.2%} | "
                         f"{v['gc_share_on']:.2%} | {_overhead_verdict(w, name)} | {_bound_verdict(w, name)} |")
    return lines



def runtime(d: dict, section: str | None) -> list[str]:
    m = d["machine"]
    if section == "hf":
        s = d["shape"]
        lines = [f"hidden {s['hidden']}, ffn {s['ffn']}, {s['experts']} experts, top-{s['top_k']}, {s['dtype']}; "
                 f"torch {m['torch']} ({m['cpu_threads']} thread), transformers {d['transformers']}, medians of "
                 f"{d['rounds']} rounds:", "",
                 "| tokens/forward | moescope tok/s | HF eager tok/s | moescope / HF | max abs diff |",
                 "|---:|---:|---:|---:|---:|"]
        for r in d["results"]:
            lines.append(f"| {r['tokens']} | {r['ours_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | "
                         f"{r['speedup_vs_hf']:.2f}x | {r['max_abs_diff']:.1e} |")
        lines += ["", f"Copy bandwidth in the same run: {d['copy_bandwidth_gb_s']:.1f} GB/s; the single-token floor "
                  f"({s['top_k']} experts x {d['expert_bytes'] / 1e6:.1f} MB / bandwidth) is "
                  f"{d['bandwidth_floor_1_token_s'] * 1e3:.2f} ms, and moescope's layer takes "
                  f"{d['ours_1_token_over_floor']:.2f}x that"
                  + (" (under the floor: a memory copy measures less bandwidth than reading the weights reached in "
                     "this run, so the floor is an estimate, not a bound)." if d["ours_1_token_over_floor"] < 1
                     else ".")]
        return lines
    if section == "grouped":
        rows = d["grouped"]
        lines = [f"Medians of {d['rounds']} interleaved rounds; every row bit-equal: "
                 f"{'yes' if all(r['bit_equal'] for r in rows) else 'NO'}.", "",
                 "| experts | hidden x ffn | top-k | tokens | slots | grouped ms | loop ms | loop / grouped |",
                 "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['experts']} | {r['hidden']} x {r['ffn']} | {r['top_k']} | {r['tokens']} | "
                         f"{r['slots']} | {r['grouped_s'] * 1e3:.3f} | {r['loop_s'] * 1e3:.3f} | "
                         f"{r['loop_over_grouped']:.2f}x |")
        return lines
    if section == "serving":
        rows = d["serving"]
        lines = [f"{rows[0]['requests']} requests queued at once, greedy:", "",
                 "| model | experts path | MoE layers x experts | tokens/s | / tiny-demo |", "|---|---|---|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['model']} | {r['experts_path']} | {r['moe_layers']} x {r['experts']} | "
                         f"{r['tokens_per_s']:.1f} | {r['ratio_to_tiny_demo']:.3f}x |")
        return lines
    raise SystemExit("runtime.json: --section hf, grouped or serving")


def parallel(d: dict | list, section: str | None) -> list[str]:
    lines = ["| world size | rank | tokens/s | all-to-all s | share of run |", "|---:|---:|---:|---:|---:|"]
    for r in d["rows"] if isinstance(d, dict) else d:  # (a list: files from before provenance)
        lines.append(f"| {r['world_size']} | {r['rank']} | {r['tokens_per_s']:.1f} | {r['all_to_all_s']:.3f} | "
                     f"{r['all_to_all_share']:.1%} |")
    return lines


def cache(d: dict, section: str | None) -> list[str]:
    c = d["config"]
    lines = [f"{c['n_layers']} MoE layers x {c['n_experts']} experts, top-{c['top_k']}, hidden {c['hidden_size']}, "
             f"ffn {c['ffn_size']}; {d['requests']} requests, max batch {d['max_batch']}, medians of {d['rounds']} "
             "rounds:", "",
             "| cache (experts/layer) | tier | tokens/s | vs all resident | token p50 ms | token p99 ms | hit rate | "
             "load p50 ms | load p99 ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f}"

    for r in d["rows"]:
        lines.append(f"| {r['cache']} ({r['size']}) | {r['tier']} | {r['tokens_per_s']:.1f} | {r['vs_all']:.2f}x | "
                     f"{r['token_p50_s'] * 1e3:.1f} | {r['token_p99_s'] * 1e3:.1f} | {r['hit_rate']:.3f} | "
                     f"{ms(r['load_p50_s'])} | {ms(r['load_p99_s'])} |")
    return lines


def cache_sim(d: dict, section: str | None) -> list[str]:
    return [f"Synthetic routing, {d['n_layers']} MoE layers x {d['n_experts']} experts, top-{d['top_k']}, "
            f"{d['steps']} steps ({d['lookups']:,} lookups); medians of {d['rounds']} rounds:", "",
            "| every size 1..E, one pass per policy | one size, per-size replay | every size, per-size replay "
            "(estimated) | speed-up |", "|---:|---:|---:|---:|",
            f"| {d['sweep_all_sizes_s']:.2f} s | {d['per_size_one_size_s']:.2f} s (size {d['compared_size']}) | "
            f"{d['per_size_all_sizes_estimate_s']:.0f} s | {d['speedup_vs_per_size_all_sizes']:.0f}x |"]


def _worst(by_layer: dict) -> float:
    return max(by_layer.values())


def mitigate(d: dict, section: str | None) -> list[str]:
    if section == "load-aware":
        lines = ["| traffic | load CV off (worst layer) | CV on (worst layer) | rerouted slots (per layer) | "
                 "output tokens identical to unmitigated |", "|---|---:|---:|---|---:|"]
        for name, r in d["load_aware"].items():
            slots = " / ".join(f"{v:,}" for v in r["rerouted_slots"].values())
            lines.append(f"| {name} | {_worst(r['cv_off']):.3f} | {_worst(r['cv_on']):.3f} | {slots} | "
                         f"{_pct(r['tokens_identical'])} |")
        return lines
    if section == "smoothing":
        s = d["smoothing"]
        return ["| margin | canary flip rate under `jitter`, off (worst layer) | on (worst layer) | "
                "healthy output identical with smoothing on |", "|---:|---:|---:|---:|",
                f"| {s['margin']:g} | {_pct(_worst(s['jitter_flip_off']))} | {_pct(_worst(s['jitter_flip_on']))} | "
                f"{_pct(s['healthy_tokens_identical'])} |"]
    raise SystemExit("mitigate.json: --section load-aware or smoothing")


def traces(d: dict, section: str | None) -> list[str]:
    return ["| figure | value |", "|---|---:|",
            f"| store | {d['requests']:,} requests, {d['tokens']:,} tokens |",
            f"| write | {d['write_s']:.2f} s: {d['token_layer_records_per_s']:,.0f} token-layer records/s |",
            f"| on disk | {d['store_bytes'] / 2**20:.1f} MiB: {d['bytes_per_token_layer']:.1f} bytes per "
            "token-layer |",
            f"| `moescope trace ID --json` (a subprocess) | {d['trace_json_cli_s']:.2f} s wall |",
            f"| one request loaded in process | {d['load_request_in_process_s'] * 1e3:.1f} ms |",
            f"| `moescope requests` (a subprocess) | {d['requests_cli_s']:.2f} s wall |",
            f"| interpreter and import start-up alone | {d['startup_cli_s']:.2f} s |"]


def _delivered(row: dict) -> str:
    got = row["delivered"]
    if not got:
        return "none"
    extra = [a for a in got if a != row["expected"]]
    said = ", ".join(got)
    return said + (f" (**{len(extra)} beyond the expected**)" if extra else "")


def detection_matrix(d: dict, section: str | None) -> list[str]:
    head = (f"`for` {d['for']}, scrape and rule evaluation every {d['scrape_and_eval_interval']}, seconds counted "
            f"from Prometheus' first scrape after a {d['warmup_s']} s warm-up.")
    if section == "tiny-demo":
        lines = [f"tiny-demo; {head}", "", "| scenario | expected alert | alerts delivered (the Watchdog aside) | "
                 "seconds to detect |", "|---|---|---|---:|"]
        for name, r in sorted(d["matrix"].items(), key=lambda kv: (kv[0] != "healthy", kv[0])):
            ttd = "-" if r["seconds_to_detect"] is None else f"{r['seconds_to_detect']:.1f}"
            lines.append(f"| `{name}` | {r['expected'] or 'none'} | {_delivered(r)} | {ttd} |")
        return lines
    if section == "shape":
        (shape,) = [k for k in d if k not in ("for", "scrape_and_eval_interval", "warmup_s", "matrix", "provenance")]
        rows = d[shape]
        model = next(iter(rows.values())).get("model", shape)
        lines = [f"{model}; {head}", "", "| scenario | expected alert | alerts delivered (the Watchdog aside) | "
                 "seconds to detect | `diagnose` named (exit) |", "|---|---|---|---:|---|"]
        for name, r in sorted(rows.items(), key=lambda kv: (kv[0] != "healthy", kv[0])):
            ttd = "-" if r["seconds_to_detect"] is None else f"{r['seconds_to_detect']:.1f}"
            scen = f"`{name}`" + (f" (`{r['scenario']}`)" if r.get("scenario") else "")
            named = ", ".join(r.get("diagnose_named") or []) or "nothing"
            lines.append(f"| {scen} | {r['expected'] or 'none'} | {_delivered(r)} | {ttd} | {named} "
                         f"({r.get('diagnose_exit')}) |")
        return lines
    raise SystemExit("detection-matrix.json: --section tiny-demo or shape")


def soak(d: dict, section: str | None) -> list[str]:
    lines = [f"{d['model']}, max batch {d['max_batch']}, {d['max_tokens']} tokens per request, "
             f"{d['clients_per_server']} closed-loop streaming clients per server, {d['seconds']:g} s, RSS slope "
             f"fitted after a {d['warmup_s']:g} s warm-up; {d['cpus']} CPUs, torch {d['torch']}:", "",
             "| server | requests (after warm-up) | errors | 429s | RSS start -> after warm-up -> end | "
             "slope per 1,000 requests | growth after warm-up | in the trace store at the end |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for name, r in d["results"].items():
        lines.append(f"| {name.replace('_', ' ')} | {r['requests']:,} ({r['requests_after_warmup']:,}) | "
                     f"{r['errors']} | {r.get('rejected_429', '-')} | {r['rss_mb_start']:.1f} -> "
                     f"{r['rss_mb_after_warmup']:.1f} -> {r['rss_mb_end']:.1f} MB | "
                     f"{r['rss_kb_per_1000_requests']:+,.0f} KB | {r['growth_after_warmup_pct']:+.2f}% | "
                     f"{format(r['stored_of_answered'], ',') if 'stored_of_answered' in r else '-'} |")
    return lines


def demo_model(d: dict, section: str | None) -> list[str]:
    loads = d["expert_load_by_domain"]
    layers = sorted(next(iter(loads.values())), key=int)
    n = len(next(iter(next(iter(loads.values())).values())))
    lines = [f"| layer | domain | {' | '.join(f'e{i}' for i in range(n))} |", "|---|---|" + "---:|" * n]
    for layer in layers:
        for dom, by_layer in loads.items():
            shares = by_layer[layer]
            top = max(range(n), key=lambda i: shares[i])
            cells = [f"**{round(x * 100)}**" if i == top else f"{round(x * 100)}" for i, x in enumerate(shares)]
            lines.append(f"| {layer} | {dom} | {' | '.join(cells)} |")
    jsd = d["specialisation"]["mean_pairwise_jsd_bits"]
    t = d["train"]
    lines += ["", f"Mean pairwise Jensen-Shannon divergence between the domains' loads, per layer: "
              f"{', '.join(f'{jsd[k]:.2f}' for k in sorted(jsd, key=int))} bits ({t['steps']} training steps, "
              f"load-balancing loss {t['aux_coef']:g})."]
    return lines


def _ms(f: dict) -> str:
    return f"best {f['best_ms']:g} ms, median {f['median_ms']:g} ms"


def _spread(xs: list) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def scale(d: dict, section: str | None) -> list[str]:
    """benchmarks/scale.py's figures at deepseek-v3-shape: serving cost, the trace store, the views, the scrape."""
    sv, st, v, sc = d["serving"], d["store"], d["views"], d["scrape"]
    m, t = sv["metrics"], sv["metrics+traces"]
    one = sc["one_rank"]
    lines = [f"| measure ({d['model']}, {st['moe_layers']} MoE layers, top-{st['top_k']}) | figure |", "|---|---|",
             f"| serving, capture off | {sv['bare_s']:.2f} s for {sv['requests']} requests x {sv['output_tokens']} "
             f"tokens, {sv['concurrency']} concurrent |",
             f"| serving with metrics, capture on / off (the kill switch, one process) | {m['ratio']:.2f}x wall "
             f"(median of {sv['rounds']} rounds' ratios; quartiles {m['q1']:.2f}-{m['q3']:.2f}), "
             f"{m['cpu_ratio']:.2f}x CPU |",
             f"| serving with metrics + the trace writer, on / off | {t['ratio']:.2f}x wall (quartiles "
             f"{t['q1']:.2f}-{t['q3']:.2f}), {t['cpu_ratio']:.2f}x CPU (dropped {t['dropped']}) |",
             f"| trace store | {st['bytes_per_token_layer']:g} bytes per token-layer at k = {st['top_k']} "
             f"({st['bytes']:,} bytes, {st['tokens']:,} tokens x {st['moe_layers']} layers, "
             f"{st['requests']} requests) |",
             f"| `moescope requests --json` | {v['requests']['median_s']:g} s (best {v['requests']['best_s']:g}) |",
             f"| `moescope trace ID --json`, the longest request ({v['trace_json']['tokens']} tokens) | "
             f"{v['trace_json']['median_s']:g} s (best {v['trace_json']['best_s']:g}), "
             f"{v['trace_json']['json_bytes']:,} bytes |",
             f"| `moescope report` on that store | {v['report']['median_s']:g} s (best {v['report']['best_s']:g}), "
             f"{v['report']['files']} files |"]
    for state in ("serving", "idle"):
        tx, om = one[state]["text"], one[state]["openmetrics_gzip"]
        lines.append(f"| scrape, 1 rank {state}: text / OpenMetrics + gzip | {_ms(tx)} / {_ms(om)}; "
                     f"{tx['bytes']:,} / {om['bytes']:,} bytes, {tx['samples']:,} samples |")
    two = sc.get("two_ranks")
    if two:
        tier = {True: "per-expert tier", False: "per-layer tier (the per-expert budget is the default / W)"}.get(
            two.get("per_expert_tier"), "tier not recorded")
        for fmt, said in (("text", "text"), ("openmetrics_gzip", "OpenMetrics + gzip")):
            r0, r1 = two["rank0"][fmt], two["rank1"][fmt]
            lines.append(f"| scrape, 2 ranks serving: rank 0 / rank 1 ({said}; {tier}) | {_ms(r0)} / {_ms(r1)}; "
                         f"{r0['bytes']:,} / {r1['bytes']:,} bytes, {r0['samples']:,} / {r1['samples']:,} samples |")
    w = sc["writers"]
    lines += [f"| {w['series']:,} counters rendered: prometheus_client / moescope's writer | "
              f"{w['median_ms']['prometheus_client']:g} / {w['median_ms']['fast']:g} ms ({w['ratio']:g}x) |", "",
              f"Per-round ratios: metrics {_spread(m['ratios'])}, with traces {_spread(t['ratios'])}."]
    return lines


def cost_model(d: dict, section: str | None) -> list[str]:
    """benchmarks/cost_model.py: what moescope does per layer, step, request, token and interval, and what it costs
    (``--section runtime`` / ``gc`` / ``hf``)."""
    if section == "gc":
        return ["| model | concurrent requests | engine steps | GC-tracked objects held per step until the evaluation "
                "| one full collection (ms) | objects the collector tracks |", "|---|---:|---:|---:|---:|---:|"] + [
            f"| {g['model']} | {g['batch']} | {g['steps']} | {g['held_objects_per_step']:.1f} | "
            f"{g['full_collection_ms']:.0f} | {g['tracked_objects']} |" for g in d["gc"]]
    if section == "hf":
        h = d["hf"]
        w = h["work_per_forward"]
        q = quartiles(h["ratios"])
        return [f"{h['model']}: capture off {h['bare_us'] / 1e3:.2f} ms, on {h['metrics_us'] / 1e3:.2f} ms a forward; "
                f"ratio {h['ratio']:.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(h['ratios'])} rounds of off and on "
                f"with the capture switch); goal <= 1.05x (issue [lean]): {verdict(h['ratios'], 1.05)}. moescope's "
                f"work inside one forward: {w['moescope_calls']} Python calls, {w['torch_ops']} torch operations that "
                f"compute, {w.get('metadata_reads', '?')} reads of a tensor's metadata (shape, dtype, dim: the "
                "hooks find the router's outputs by them and keep references; every statistic is computed on the "
                "evaluator's thread)."]
    lines = ["| model | concurrent requests | variant | per MoE layer: us (Python calls) | per step: us (calls) | "
             "per request: us (calls) | per output token: us | per interval: ms (steps) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in d["runtime"]:
        w = r["work"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['per_layer_us']:.2f} "
                     f"({w['layer']['moescope_calls']}) | {r['per_step_us']:.2f} ({w['step']['moescope_calls']}) | "
                     f"{r['per_request_us']:.1f} ({w['request_96_tokens']['moescope_calls']}) | "
                     f"{r['per_token_us']:.2f} | {r['per_interval_us'] / 1e3:.1f} ({r['interval_steps']}) |")
    return lines


RENDER = {"overhead": overhead, "cost_model": cost_model, "cost_model-before": cost_model, "runtime": runtime,
          "parallel": parallel, "cache": cache, "cache-sim": cache_sim,
          "mitigate": mitigate, "traces": traces, "detection-matrix": detection_matrix, "tiny-demo": demo_model,
          "scale": scale}


def render(path: Path, section: str | None) -> str:
    d = json.loads(path.read_text())
    stem = path.stem.removesuffix("-quick")
    fn = soak if isinstance(d, dict) and d.get("mode") == "soak" else RENDER.get(stem)
    if fn is None:
        raise SystemExit(f"no table for {path}")
    return "\n".join(fn(d, section)) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, required=True)
    ap.add_argument("--section", default=None)
    args = ap.parse_args(argv)
    print(render(args.markdown, args.section), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
