"""Runs in each spawned gloo rank of the parallel tests (importable by torch.multiprocessing)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def run(rank: int, world: int, port: int, cfg_dict: dict, layout: str, out_dir: str) -> None:
    from moescope.parallel import placement
    from moescope.parallel.expert_parallel import ExpertParallel
    from moescope.runtime import traffic
    from moescope.runtime.config import from_dict
    from moescope.runtime.engine import Engine
    from moescope.runtime.model import MoETransformer, Segment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = from_dict(cfg_dict)
    model = MoETransformer(cfg).eval()
    pl = placement.build(layout, n_experts=cfg.n_experts, world_size=world, moe_layers=cfg.moe_layers)
    ep = ExpertParallel(pl, rank, world)
    for layer in model.moe_layers():
        layer.parallel = ep
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (37,), generator=gen)  # 37: chunks of unequal size on every world size
    with torch.no_grad():
        logits = model(tokens, [Segment(20), Segment(17)]).logits
    records = Engine(model, max_batch=3).run(traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=6),
                                                              5), realtime=False, id_prefix="t-")
    torch.save({"logits": logits, "outputs": [r.output_tokens for r in records]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
