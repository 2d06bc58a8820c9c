"""vLLM's default EPLB policy (DeepSeek's EPLB), ported to numpy: the placement vLLM would compute for a load.

``rebalance`` returns what vLLM's ``DefaultEplbPolicy.rebalance_experts`` returns for the same arguments
(``vllm/distributed/eplb/policy/default.py``, identical in vLLM 0.31, 0.32 and 0.33): the physical-to-logical map
[layers, physical experts], physical expert ``p`` on rank ``p // (physical / ranks)``. ``replica_counts`` gives
vLLM's ``logical_replica_count`` from it (``eplb_state.compute_logical_maps``). tests/test_eplb_policy.py asserts
both equal vLLM's own on several loads, the hierarchical (groups over nodes) and the global cases, in the vLLM
environment. Ported rather than imported: moescope predicts EPLB on engines that have no vLLM installed (the
reference runtime, HF), and vLLM's module imports torch and vLLM's config at import time.

The algorithm, per layer (all layers at once, as vLLM vectorises it):
1. hierarchical, when the expert groups divide evenly over the nodes: pack groups onto nodes so every node gets
   the same number of groups and the nodes' loads are as even as greedy packing makes them (heaviest group first,
   onto the lightest node with room);
2. within each node, give the spare physical slots (``physical - logical``) one by one to the expert with the
   highest load per replica (``argmax(load / replicas)``, the lowest id among equals);
3. pack the replicas onto the node's ranks the same greedy way, each replica weighing its expert's load over its
   replica count.
Without groups dividing the nodes it runs the same with one group and one node (global balanced packing).
``old`` (the map in use) reorders each rank's slots so an expert staying on its rank keeps its slot (no copy).
"""

from __future__ import annotations

import numpy as np

from moescope.errors import BadInput


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """([X, n] pack of each item, [X, n] its position in the pack): n items into ``num_packs`` packs of n/packs
    items each, heaviest first onto the lightest pack with room (vLLM's ``balanced_packing``)."""
    num_layers, num_groups = weight.shape
    per_pack = num_groups // num_packs
    if per_pack == 1:
        pack = np.tile(np.arange(num_groups, dtype=np.int64), (num_layers, 1))
        return pack, np.zeros_like(pack)
    order = np.argsort(-weight, axis=-1)  # (numpy's default quicksort, as vLLM's call: the same ties)
    pack = np.full((num_layers, num_groups), -1, dtype=np.int64)
    rank = np.full((num_layers, num_groups), -1, dtype=np.int64)
    pack_weight = np.zeros((num_layers, num_packs), dtype=np.float64)
    pack_items = np.zeros((num_layers, num_packs), dtype=np.int64)
    rows = np.arange(num_layers)
    # vLLM loops layer by layer; the layers are independent, so the j-th heaviest item of every layer is placed at
    # once (argmin per row picks the first lightest pack, as vLLM's per-layer argmin): the same packing
    for j in range(num_groups):
        g = order[:, j]
        p = np.argmin(pack_weight, axis=1)  # a full pack weighs inf
        pack[rows, g] = p
        rank[rows, g] = pack_items[rows, p]
        pack_weight[rows, p] += weight[rows, g]
        pack_items[rows, p] += 1
        full = pack_items[rows, p] == per_pack
        pack_weight[rows[full], p[full]] = np.inf
    return pack, rank


def replicate(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """([X, num_phy] logical expert of each physical one, [X, num_log] replicas of each logical one): the spare
    slots to the highest load per replica in turn (vLLM's ``replicate_experts``)."""
    n, num_log = weight.shape
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (n, 1))
    logcnt = np.ones((n, num_log), dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    for i in range(num_log, num_phy):
        hot = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = hot
        logcnt[rows, hot] += 1
    return phy2log, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[np.arange(perm.shape[0])[:, None], perm] = np.arange(perm.shape[1], dtype=np.int64)
    return inv


def hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    """[layers, num_phy] physical-to-logical map (vLLM's ``rebalance_experts_hierarchical``)."""
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1: groups onto nodes
    group_weight = weight.reshape(num_layers, num_groups, group_size).sum(axis=-1)
    g_pack, g_rank = balanced_packing(group_weight, num_nodes)
    log2mlog = (((g_pack * groups_per_node + g_rank)[..., None] * group_size)
                + np.arange(group_size, dtype=np.int64)).reshape(num_layers, num_log)
    mlog2log = _inverse(log2mlog)
    # 2: replicas within each node
    node_weight = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, num_log // num_nodes)
    phy2mlog, mlogcnt = replicate(node_weight, num_phy // num_nodes)
    # 3: replicas onto the node's GPUs, each weighing its expert's load / its replicas
    per_phy = np.take_along_axis(node_weight / mlogcnt, phy2mlog, axis=1)
    pack, rank = balanced_packing(per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1)
                 + np.arange(0, num_log, num_log // num_nodes, dtype=np.int64)[None, :, None]).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def preserve_slots(phy2log: np.ndarray, num_ranks: int, old: np.ndarray) -> np.ndarray:
    """``phy2log`` with each rank's slots reordered so an expert that stays on its rank keeps its old slot (vLLM's
    ``preserve_intragpu_slots``)."""
    num_layers, num_phy = phy2log.shape
    if num_ranks <= 0 or num_phy % num_ranks:
        return phy2log
    per = num_phy // num_ranks
    out = phy2log.copy()
    for gpu in range(num_ranks):
        lo = gpu * per
        old_local, new_local = old[:, lo:lo + per], phy2log[:, lo:lo + per]
        used = np.zeros((num_layers, per), dtype=bool)
        kept = np.zeros((num_layers, per), dtype=bool)
        for slot in range(per):  # an expert still here keeps its slot
            match = (new_local == old_local[:, slot][:, None]) & ~used
            has = match.any(axis=1)
            if has.any():
                first = np.argmax(match, axis=1)
                rows = np.nonzero(has)[0]
                out[rows, lo + slot] = new_local[rows, first[rows]]
                used[rows, first[rows]] = True
                kept[rows, slot] = True
        remaining, free = ~used, ~kept  # the incoming experts fill the free slots in order
        if remaining.any() and free.any():
            base = np.tile(np.arange(per), (num_layers, 1))
            src_order = np.argsort(np.where(remaining, base, per + 1), axis=1)
            dst_order = np.argsort(np.where(free, base, per + 1), axis=1)
            take = np.minimum(remaining.sum(axis=1), free.sum(axis=1))
            for layer in range(num_layers):
                k = int(take[layer])
                if k > 0:
                    out[layer, lo + dst_order[layer, :k]] = new_local[layer, src_order[layer, :k]]
    return out


def rebalance(weight, num_replicas: int, num_groups: int = 1, num_nodes: int = 1, num_ranks: int = 1,
              old: np.ndarray | None = None) -> np.ndarray:
    """[layers, num_replicas] int64 physical-to-logical map for ``weight`` [layers, logical experts] (vLLM's
    ``DefaultEplbPolicy.rebalance_experts`` with the same arguments; ``old``: the map in use, or None).

    Raises:
        BadInput: a shape vLLM's policy cannot place (physical experts not a multiple of the ranks, fewer physical
            than logical experts, experts not a multiple of the groups).
    """
    w = np.asarray(weight, dtype=np.float32).astype(np.float64)  # vLLM: weight.float().numpy()
    if w.ndim != 2:
        raise BadInput(f"EPLB's load is [layers, experts], got shape {w.shape}")
    num_log = w.shape[1]
    if num_replicas < num_log or num_replicas % num_ranks:
        raise BadInput(f"EPLB places {num_replicas} physical experts ({num_log} logical + redundant) on "
                       f"{num_ranks} ranks: it needs physical >= logical and a multiple of the ranks")
    if num_groups < 1 or num_log % num_groups or num_ranks % num_nodes:
        raise BadInput(f"EPLB: {num_log} experts in {num_groups} groups on {num_nodes} nodes x {num_ranks} ranks "
                       "do not divide evenly")
    if num_groups % num_nodes == 0:
        out = hierarchical(w, num_replicas, num_groups, num_nodes, num_ranks)
    else:
        out = hierarchical(w, num_replicas, 1, 1, num_ranks)
    if old is not None:
        out = preserve_slots(out, num_ranks, np.asarray(old, dtype=np.int64))
    return out


def initial(num_logical: int, num_redundant: int) -> np.ndarray:
    """[physical] vLLM's map before its first rearrangement (``build_initial_global_physical_to_logical_map``): the
    logical experts in order, then the redundant slots holding experts 0, 1, ... again."""
    return np.array(list(range(num_logical)) + [i % num_logical for i in range(num_redundant)], dtype=np.int64)


def replica_counts(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """[layers, logical] replicas of each logical expert (vLLM's ``logical_replica_count``; -1 slots are empty)."""
    p = np.atleast_2d(np.asarray(phy2log, dtype=np.int64))
    out = np.zeros((p.shape[0], num_logical), dtype=np.int64)
    rows = np.repeat(np.arange(p.shape[0]), p.shape[1])
    flat = p.ravel()
    ok = flat >= 0
    np.add.at(out, (rows[ok], flat[ok]), 1)
    return out
