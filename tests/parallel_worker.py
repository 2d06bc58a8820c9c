"""Runs in each spawned gloo rank of the parallel tests (importable by torch.multiprocessing)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# Per rank: the tokens of one direct forward (rank 2 has none: it runs an idle forward), and the requests it
# serves: request i on rank i mod W, 7 requests, so ranks hold different counts and finish at different steps.
FORWARD_TOKENS = (37, 5, 0, 12)
N_REQUESTS = 7


def forward_tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (FORWARD_TOKENS[rank],), generator=torch.Generator().manual_seed(11 + rank))


def requests(rank: int, world: int):
    from moescope.runtime import traffic

    return traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=6), N_REQUESTS)[rank::world]


REBALANCE_START = ((0, 1, 2, 4, 6), (0, 1, 3, 5, 7))  # 8 experts on 2 ranks, two replicated


def start_placement(layout: str, cfg, world: int):
    from moescope.parallel import placement

    if layout == "rebalance":
        return placement.validate({layer: REBALANCE_START for layer in cfg.moe_layers}, cfg.n_experts, world, True,
                                  cfg.moe_layers)
    return placement.build(layout, n_experts=cfg.n_experts, world_size=world, moe_layers=cfg.moe_layers)


def run(rank: int, world: int, port: int, cfg_dict: dict, layout: str, out_dir: str, device: str = "cpu") -> None:
    """``device`` cuda: the ranks compute on CUDA (each on GPU rank mod the GPUs) and exchange over gloo through
    host memory, as `--world-size` ranks sharing a GPU do (``ExpertParallel`` stages the tensors)."""
    from moescope.parallel.expert_parallel import ExpertParallel
    from moescope.runtime.model_config import from_dict
    from moescope.runtime.engine import Engine
    from moescope.runtime.model import MoETransformer, Segment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = from_dict(cfg_dict)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    model = MoETransformer(cfg).eval().to(device)
    rebalance = layout == "rebalance"  # experts 0 and 1 on both ranks, then EPLB every 3 steps, 5 slots per rank
    pl = start_placement(layout, cfg, world)
    if rebalance:  # the experts this rank does not hold yet are poison: only the weights a move sends can serve
        with torch.no_grad():
            for layer in model.moe_layers():
                held = set(pl.layers[layer.layer_index][rank])
                for e in range(cfg.n_experts):
                    if e not in held:
                        layer.experts.gate_up_proj[e].fill_(float("nan"))
                        layer.experts.down_proj[e].fill_(float("nan"))
    rows: dict[int, list[int]] = {}  # physical load of the direct forward: rows this rank computed per expert

    class Rows:
        def on_all_to_all(self, record):
            if record.op == "dispatch" and record.expert_rows:
                rows[record.layer] = [a + max(b, 0) for a, b in zip(rows.get(record.layer, [0] * cfg.n_experts),
                                                                    record.expert_rows)]

    observer = Rows()
    ep = ExpertParallel(pl, rank, world, observer=lambda: observer)
    for layer in model.moe_layers():
        layer.parallel = ep
    tokens = forward_tokens(rank).to(device)
    logits = None
    with torch.no_grad():
        if len(tokens):
            logits = model(tokens, [Segment(len(tokens))]).logits.cpu()
        else:
            ep.idle_forward(model.moe_layers())
    ep.observer = None
    if rebalance:
        from moescope.parallel.eplb import Rebalancer

        ep.rebalancer = Rebalancer(3, slots=5)
    records = Engine(model, max_batch=3, lockstep=ep).run(requests(rank, world), realtime=False, id_prefix="t-")
    torch.save({"logits": logits, "outputs": [r.output_tokens for r in records],
                "ids": [r.request_id for r in records], "dispatches": ep.dispatches, "rows": rows,
                "rebalances": [(e.step, e.moved, e.layers) for e in ep.events]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
