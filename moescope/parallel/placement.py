"""Expert placement: which rank computes which experts, per MoE layer.

YAML (or JSON) form, the same map for every MoE layer unless ``layers`` overrides one::

    rank_to_experts: {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    layers:                       # optional per-layer overrides
      2: {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    replicated: false             # true allows an expert on several ranks (hot-expert replication)

Validation: ranks are 0..W-1, each layer places every expert at least once, and exactly once unless
``replicated``. Logical experts are the model's E; physical experts are the placed copies (>= E with
replicas). A replicated expert's slots are dealt over its replicas in turn by every rank that routes them
(``ExpertParallel._destinations``): each replica computes 1/R of the expert's slots, up to one slot per
routing rank and layer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from moescope.errors import BadInput

LAYOUTS = ("round-robin", "contiguous")


@dataclass(frozen=True)
class Placement:
    world_size: int
    n_experts: int
    layers: Mapping[int, tuple[tuple[int, ...], ...]]  # MoE layer -> experts of each rank
    replicated: bool = False

    def ranks_of(self, layer: int, expert: int) -> tuple[int, ...]:
        return tuple(r for r, experts in enumerate(self.layers[layer]) if expert in experts)

    def owner_table(self, layer: int, sender: int) -> list[int]:
        """Destination rank of each expert (index E: the dropped-slot sentinel, -1) as seen from ``sender``
        (a replicated expert: its first replica; the dispatcher deals its slots over all of them)."""
        table = []
        for e in range(self.n_experts):
            ranks = self.ranks_of(layer, e)
            table.append(sender if sender in ranks else ranks[0])
        return table + [-1]


def _layout(kind: str, n_experts: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    if kind == "round-robin":
        return tuple(tuple(e for e in range(n_experts) if e % world_size == r) for r in range(world_size))
    if kind == "contiguous":
        per, extra = divmod(n_experts, world_size)
        out, start = [], 0
        for r in range(world_size):
            n = per + (r < extra)
            out.append(tuple(range(start, start + n)))
            start += n
        return tuple(out)
    raise BadInput(f"unknown placement layout {kind!r}; choose one of {', '.join(LAYOUTS)} or a YAML file")


def validate(layers: Mapping[int, Sequence[Sequence[int]]], n_experts: int, world_size: int,
             replicated: bool, moe_layers: Sequence[int], source: str = "placement") -> Placement:
    out = {}
    for layer in moe_layers:
        if layer not in layers:
            raise BadInput(f"{source}: no placement for MoE layer {layer}")
        per_rank = layers[layer]
        if len(per_rank) != world_size:
            raise BadInput(f"{source}: layer {layer} places experts on {len(per_rank)} ranks, world size is "
                           f"{world_size}")
        seen: dict[int, int] = {}
        for rank, experts in enumerate(per_rank):
            for e in experts:
                if not isinstance(e, int) or not 0 <= e < n_experts:
                    raise BadInput(f"{source}: layer {layer} rank {rank}: expert {e!r} outside 0..{n_experts - 1}")
                seen[e] = seen.get(e, 0) + 1
        missing = sorted(set(range(n_experts)) - set(seen))
        if missing:
            raise BadInput(f"{source}: layer {layer}: experts {missing} are placed on no rank")
        twice = sorted(e for e, n in seen.items() if n > 1)
        if twice and not replicated:
            raise BadInput(f"{source}: layer {layer}: experts {twice} are placed more than once "
                           f"(set replicated: true to replicate on purpose)")
        out[layer] = tuple(tuple(sorted(set(x))) for x in per_rank)
    return Placement(world_size, n_experts, out, replicated)


def build(spec: str, *, n_experts: int, world_size: int, moe_layers: Sequence[int]) -> Placement:
    """``round-robin``, ``contiguous``, or a path to a YAML/JSON placement file."""
    if spec in LAYOUTS:
        layout = _layout(spec, n_experts, world_size)
        return validate({layer: layout for layer in moe_layers}, n_experts, world_size, False, moe_layers)
    return load(spec, n_experts=n_experts, world_size=world_size, moe_layers=moe_layers)


def load(path: str | Path, *, n_experts: int, world_size: int, moe_layers: Sequence[int]) -> Placement:
    import yaml  # start-up: yaml, only when load() runs

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BadInput(f"cannot read placement {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"cannot parse placement {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rank_to_experts", data.get("layers")), dict):
        raise BadInput(f"placement {path}: expected a mapping with rank_to_experts (and optional layers)")

    def per_rank(mapping, where):
        try:
            ranks = {int(r): list(v) for r, v in mapping.items()}
        except (TypeError, ValueError):
            raise BadInput(f"placement {path}: {where} must map rank numbers to lists of experts") from None
        bad = sorted(r for r in ranks if not 0 <= r < world_size)
        if bad:
            raise BadInput(f"placement {path}: {where} names ranks {bad}, which do not exist (world size "
                           f"{world_size})")
        return [ranks.get(r, []) for r in range(world_size)]

    default = per_rank(data["rank_to_experts"], "rank_to_experts") if "rank_to_experts" in data else None
    layers = {layer: default for layer in moe_layers if default is not None}
    for layer, mapping in (data.get("layers") or {}).items():
        layers[int(layer)] = per_rank(mapping, f"layer {layer}")
    return validate(layers, n_experts, world_size, bool(data.get("replicated", False)), moe_layers, str(path))


def to_yaml(placement: Placement) -> str:
    """The YAML form (per-layer maps), as `moescope plan-placement` writes it."""
    import yaml  # start-up: yaml, only when to_yaml() runs

    first = next(iter(placement.layers.values()))
    same = all(v == first for v in placement.layers.values())
    data: dict = {"world_size": placement.world_size, "replicated": placement.replicated}
    if same:
        data["rank_to_experts"] = {r: list(x) for r, x in enumerate(first)}
    else:
        data["layers"] = {layer: {r: list(x) for r, x in enumerate(v)} for layer, v in placement.layers.items()}
    return yaml.safe_dump(data, sort_keys=False)
