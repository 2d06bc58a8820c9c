"""Model configuration: one frozen dataclass, named presets, YAML/JSON loading.

Every constraint is checked in ``__post_init__`` so an invalid model can never be built; the error names
the field and the rule (``top_k (9) must be <= n_experts (8)``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moescope.errors import ConfigError

SCORINGS = ("softmax", "sigmoid")

# Byte-level tokenizer: 256 byte values, then the special tokens (see tokenizer.py).
BYTE_VOCAB = 256
N_SPECIAL = 4  # BOS, EOS, PAD, one spare


@dataclass(frozen=True)
class MoEConfig:
    """Shape and behaviour of a reference MoE transformer.

    Attributes:
        hidden_size: model width H.
        n_layers: transformer blocks.
        n_heads: attention heads; ``hidden_size / n_heads`` must be an even integer (RoPE).
        n_experts: routed experts E per MoE layer.
        top_k: experts chosen per token (k <= E).
        ffn_size: hidden size F of one SwiGLU expert.
        dense_layers: indices of blocks with a dense SwiGLU FFN instead of experts (DeepSeek's
            ``first_k_dense_replace``, Qwen's ``mlp_only_layers``).
        dense_ffn_size: hidden size of the dense FFN (default: ``ffn_size * top_k``, the active size).
        capacity_factor: per-expert capacity = ceil(cf * T * k / E) slots per forward; slots beyond it are
            dropped and counted. ``None`` disables capacity (no drops).
        router_temperature: logits are divided by it before scoring (> 0).
        scoring: ``softmax`` (Mixtral, Qwen-MoE: probabilities over the experts) or ``sigmoid`` (DeepSeek-V3,
            Kimi K2: an independent affinity per expert).
        n_group: experts are split into this many equal groups (``n_experts`` divisible by it).
        topk_group: group-limited routing: only the ``topk_group`` groups with the best group score (sum of
            each group's two best selection scores) may be chosen from (default: every group).
        correction_bias: the router holds a per-expert score-correction bias (a buffer, DeepSeek-V3's
            aux-loss-free balancing): selection uses scores + bias, gate weights the unbiased scores.
        norm_topk_prob: gate weights are the chosen scores divided by their sum (softmax top-k models
            renormalise; sigmoid models add 1e-20 to the sum, as HF does).
        routed_scaling_factor: gate weights are multiplied by it (DeepSeek-V3: 2.5).
        n_shared_experts: shared experts every token runs (one SwiGLU FFN of ``shared_ffn_size``), added to
            the routed output; not routed, not counted as experts, counted as dense parameters.
        shared_ffn_size: hidden size of the shared FFN (default: ``ffn_size * n_shared_experts``, as HF).
        max_seq_len: longest sequence the KV cache holds.
        seed: seed for weight initialisation and the engine's sampling.
    """

    name: str = "custom"
    vocab_size: int = BYTE_VOCAB + N_SPECIAL
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    ffn_size: int = 128
    dense_layers: tuple[int, ...] = ()
    dense_ffn_size: int | None = None
    capacity_factor: float | None = None
    router_temperature: float = 1.0
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int | None = None
    correction_bias: bool = False
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_ffn_size: int | None = None
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_experts", "top_k", "ffn_size",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.hidden_size % self.n_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by n_heads ({self.n_heads})")
        if (self.hidden_size // self.n_heads) % 2:
            raise ConfigError(f"head size hidden_size/n_heads ({self.hidden_size // self.n_heads}) must be even")
        if self.vocab_size < BYTE_VOCAB + N_SPECIAL:
            raise ConfigError(f"vocab_size must be >= {BYTE_VOCAB + N_SPECIAL} for the byte tokenizer")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"dense_layers {bad} out of range 0..{self.n_layers - 1}")
        if self.dense_ffn_size is not None and self.dense_ffn_size <= 0:
            raise ConfigError(f"dense_ffn_size must be positive, got {self.dense_ffn_size}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor must be > 0 (or null for no capacity), got {self.capacity_factor}")
        if not self.router_temperature > 0:
            raise ConfigError(f"router_temperature must be > 0, got {self.router_temperature}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError("rope_theta and norm_eps must be > 0")
        self._check_routing()

    def _check_routing(self) -> None:
        if self.scoring not in SCORINGS:
            raise ConfigError(f"scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}")
        for name in ("correction_bias", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, low in (("n_group", 1), ("topk_group", 1), ("n_shared_experts", 0), ("shared_ffn_size", 1)):
            value = getattr(self, name)
            if value is None and name in ("topk_group", "shared_ffn_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.n_experts % self.n_group:
            raise ConfigError(f"n_experts ({self.n_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group is not None and self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        reachable = self.groups_kept * (self.n_experts // self.n_group)
        if self.top_k > reachable:
            raise ConfigError(f"top_k ({self.top_k}) must be <= the experts in the topk_group best groups "
                              f"({self.groups_kept} x {self.n_experts // self.n_group} = {reachable})")
        scale = self.routed_scaling_factor
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
            raise ConfigError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")

    # -- derived facts ---------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the blocks whose FFN is a routed MoE layer."""
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    @property
    def dense_ffn(self) -> int:
        return self.dense_ffn_size if self.dense_ffn_size is not None else self.ffn_size * self.top_k

    @property
    def groups_kept(self) -> int:
        """Groups a token may choose experts from (``topk_group``, default all)."""
        return self.n_group if self.topk_group is None else self.topk_group

    @property
    def shared_ffn(self) -> int:
        """Hidden size of the shared-expert FFN (0: none)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_ffn_size if self.shared_ffn_size is not None else self.ffn_size * self.n_shared_experts

    @property
    def plain_topk(self) -> bool:
        """Softmax top-k without groups or bias: the routing the fused Triton kernel implements."""
        return self.scoring == "softmax" and self.groups_kept == self.n_group and not self.correction_bias

    @property
    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert (gate, up, down projections)."""
        return 3 * self.hidden_size * self.ffn_size

    def replace(self, **changes: Any) -> "MoEConfig":
        """A copy with fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d


PRESETS: dict[str, MoEConfig] = {
    # The bundled demo model (trained by scripts/train_demo.py): small enough to train in minutes on 2 cores.
    "tiny-demo": MoEConfig(name="tiny-demo", hidden_size=128, n_layers=4, n_heads=4, n_experts=8, top_k=2,
                           ffn_size=128, dense_layers=(0,), dense_ffn_size=256, max_seq_len=512),
    # One Mixtral-8x7B-shaped MoE block at a quarter width, as REFERENCE.md measures (hidden 1024, ffn 2816).
    "mixtral-block": MoEConfig(name="mixtral-block", hidden_size=1024, n_layers=1, n_heads=8, n_experts=8,
                               top_k=2, ffn_size=2816),
    # DeepSeek-V3-shaped routing width (256 experts, top-8) at a small hidden size, for router benchmarks.
    "deepseek-v3-block": MoEConfig(name="deepseek-v3-block", hidden_size=1024, n_layers=1, n_heads=8,
                                   n_experts=256, top_k=8, ffn_size=256),
    # Production shapes at a width that serves on 2 CPU cores (REFERENCE.md, "Production shapes"): every
    # count that the metrics, alerts and views scale with (layers, experts, k, groups) is the real model's;
    # only the widths are scaled down (hidden 7168 -> 64, expert ffn 2048 -> 16, dense ffn 9x the expert's).
    "deepseek-v3-shape": MoEConfig(name="deepseek-v3-shape", hidden_size=64, n_layers=61, n_heads=4,
                                   n_experts=256, top_k=8, ffn_size=16, dense_layers=(0, 1, 2), dense_ffn_size=144,
                                   scoring="sigmoid", n_group=8, topk_group=4, correction_bias=True,
                                   norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1),
    # Qwen3-30B-A3B's shape (hidden 2048 -> 64, expert ffn 768 -> 24): 48 MoE layers, softmax top-8 of 128,
    # normalised, no shared expert.
    "qwen3-moe-shape": MoEConfig(name="qwen3-moe-shape", hidden_size=64, n_layers=48, n_heads=4, n_experts=128,
                                 top_k=8, ffn_size=24, scoring="softmax", norm_topk_prob=True),
}


def preset(name: str) -> MoEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def from_dict(data: dict[str, Any], *, source: str = "config") -> MoEConfig:
    """Build a config from a mapping; ``preset: NAME`` starts from a preset and the other keys override it."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config fields, got {type(data).__name__}")
    data = dict(data)
    base = preset(data.pop("preset")) if "preset" in data else MoEConfig()
    try:
        return base.replace(**data)
    except TypeError as exc:  # wrong value types that dataclasses.replace cannot take
        raise ConfigError(f"{source}: {exc}") from None


def load(path: str | Path) -> MoEConfig:
    """Load a config from a ``.json``, ``.yaml`` or ``.yml`` file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # start-up: yaml, only when load() runs

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml/json parse errors: report, never a traceback
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot parse config {path}: {first}") from None
    return from_dict(data, source=str(path))


def resolve(spec: str) -> MoEConfig:
    """A preset name or a path to a config file."""
    if spec in PRESETS:
        return PRESETS[spec]
    if Path(spec).suffix in (".json", ".yaml", ".yml"):
        return load(spec)
    raise ConfigError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a .json/.yaml config file")


__all__ = ["MoEConfig", "PRESETS", "preset", "from_dict", "load", "resolve"]
