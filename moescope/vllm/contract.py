"""Everything of vLLM the plugin relies on, as data, and a check of it against a vLLM source tree read with ``ast``
(never imported): the seams of both model runners (V1 and Model Runner V2), the scheduler's output, the MoE layers'
routers. ``tests/test_vllm_contract.py`` runs the check against each vLLM release the plugin lists as supported
(the installed CPU builds, and the GPU build's wheel unpacked without its dependencies), so a release that renames
or drops one of these is caught before a user runs it.

What is checked of each name: the module file exists; the class is defined there; each attribute is a field
(annotated or assigned in the class body) or assigned as ``self.NAME`` in a method of the class or of a base class
(bases followed through the module's imports); each method exists with the named parameters; each module-level
function exists with its parameters in that order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Use:
    """What the plugin uses of one class (``cls``) or of a module's functions (``cls`` None) in ``module``."""

    module: str
    cls: str | None = None
    attrs: tuple[str, ...] = ()
    methods: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, parameters it is called with, by name)
    functions: tuple[tuple[str, tuple[str, ...]], ...] = ()  # module functions: (name, leading parameters in order)
    why: str = ""


USES: tuple[Use, ...] = (
    # The runners the plugin wraps (moescope.vllm.plugin.RUNNERS) and what it reads of them after execute_model.
    Use("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", attrs=("input_batch", "requests", "vllm_config"),
        methods=(("execute_model", ("scheduler_output",)), ("load_model", ()), ("get_model", ())),
        why="V1 runner: execute_model wrapped; batch order and output tokens read"),
    Use("vllm.v1.worker.gpu_input_batch", "InputBatch", attrs=("req_ids",), why="V1 batch order"),
    Use("vllm.v1.worker.gpu_input_batch", "CachedRequestState", attrs=("output_token_ids",),
        why="V1: a finished request's generated tokens"),
    Use("vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
        attrs=("execute_model_state", "req_states", "decode_query_len", "vllm_config"),
        methods=(("execute_model", ("scheduler_output", "dummy_run")), ("load_model", ()), ("get_model", ())),
        why="Model Runner V2: execute_model wrapped (dummy runs pass through); its state after the forward"),
    Use("vllm.v1.worker.gpu.model_runner", None,
        functions=(("sort_batch_req_ids", ("num_tokens_per_req", "draft_tokens", "decode_query_len")),),
        why="Model Runner V2's batch order"),
    Use("vllm.v1.worker.gpu.model_runner", "ExecuteModelState", attrs=("input_batch",), why="MRv2 batch"),
    Use("vllm.v1.worker.gpu.input_batch", "InputBatch", attrs=("req_ids",), why="MRv2 batch order"),
    Use("vllm.v1.worker.gpu.states", "RequestState", attrs=("all_token_ids", "req_id_to_index", "prompt_len"),
        why="MRv2: a finished request's generated tokens, from its token table in host memory"),
    Use("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor", attrs=("gpu", "_uva_buf"), why="MRv2 token table"),
    Use("vllm.v1.worker.gpu.buffer_utils", "UvaBuffer", attrs=("np",), why="MRv2 token table's host view"),
    Use("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor", attrs=("np",), why="MRv2 prompt lengths"),
    Use("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", methods=(("load_model", ()),),
        why="the CPU build's V1 runner loads its own way"),
    # The scheduler's output: the seam both runners take (attribution of rows to requests).
    Use("vllm.v1.core.sched.output", "SchedulerOutput",
        attrs=("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
               "finished_req_ids", "scheduled_spec_decode_tokens"), why="step attribution"),
    Use("vllm.v1.core.sched.output", "NewRequestData",
        attrs=("req_id", "prompt_token_ids", "sampling_params", "num_computed_tokens"), why="new requests"),
    Use("vllm.v1.core.sched.output", "CachedRequestData", attrs=("req_ids", "num_computed_tokens"),
        why="where each running request stands"),
    # Routing: the routers' capture slot, the MoE layers' identity, the buffer's size.
    Use("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter", attrs=("capture_fn",),
        methods=(("set_capture_fn", ("capture_fn",)),), why="the capture slot vLLM's own capturer uses"),
    Use("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner",
        attrs=("layer_id", "layer_name", "router", "moe_config", "_quant_method"),
        why="an MoE layer as the model is built"),
    Use("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase", attrs=("is_monolithic",),
        why="a monolithic kernel calls no capture function: its layer is not watched"),
    Use("vllm.model_executor.layers.fused_moe.config", "FusedMoEConfig",
        attrs=("num_experts", "num_logical_experts", "num_local_experts", "experts_per_token", "hidden_dim",
               "intermediate_size", "device"), why="the routing shape"),
    Use("vllm.config.vllm", None, functions=(("get_current_vllm_config", ()),), why="the step buffer's size"),
    Use("vllm.config.scheduler", "SchedulerConfig", attrs=("max_num_batched_tokens",), why="buffer rows"),
    Use("vllm.config.model", "ModelConfig", attrs=("hf_text_config",), methods=(("get_total_num_hidden_layers", ()),),
        why="buffer slots; the attention shape (bytes and FLOPs per step)"),
    # [eplb] vLLM's own EPLB, read (moescope/vllm/eplb_state.py); Model Runner V2 has ``eplb_state`` from 0.32 only
    # (read with getattr, not pinned here: 0.31's MRv2 has no EPLB)
    Use("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", attrs=("eplb_state",), why="the V1 runner's EplbState"),
    Use("vllm.distributed.eplb.eplb_state", "EplbState", attrs=("model_states", "expert_rearrangement_step"),
        why="the models' EPLB maps; the host counter reset before each rearrangement"),
    Use("vllm.distributed.eplb.eplb_state", "EplbModelState",
        attrs=("physical_to_logical_map", "logical_replica_count", "rebalanced", "model"),
        why="the placement (physical slot -> logical expert), replicas, async EPLB's commit flag"),
    Use("vllm.model_executor.models.interfaces", "MixtureOfExperts",
        attrs=("num_local_physical_experts", "num_physical_experts", "num_logical_experts", "num_expert_groups"),
        why="physical slots per EP rank (the map's ranks)"),
    Use("vllm.config.parallel", "EPLBConfig", attrs=("window_size", "step_interval", "num_redundant_experts"),
        why="the --eplb-config fields plan-placement and diagnose print (moescope/ep_verdict.py)"),
    Use("vllm.distributed.eplb.policy.default", "DefaultEplbPolicy",
        methods=(("rebalance_experts", ("weight", "num_replicas", "num_groups", "num_nodes", "num_ranks",
                                        "old_global_expert_indices")),
                 ("balanced_packing", ("weight", "num_packs")), ("replicate_experts", ("weight", "num_phy"))),
        why="ported to numpy: parallel/eplb_policy.py (tests/test_eplb_policy.py compares the two)"),
)


class _Tree:
    """A vLLM source tree (the folder holding ``vllm/``), parsed lazily, one module at a time."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._parsed:
            base = self.root.joinpath(*name.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            self._parsed[name] = ast.parse(path.read_text(), str(path)) if path.is_file() else None
        return self._parsed[name]

    def cls(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """(module, ClassDef) of ``name`` as ``module`` defines or imports it."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for imp in ast.walk(tree):
            if isinstance(imp, ast.ImportFrom) and imp.module and imp.level == 0:
                for alias in imp.names:
                    if (alias.asname or alias.name) == name:
                        return self.cls(imp.module, alias.name, depth + 1)
        return None

    def members(self, module: str, node: ast.ClassDef, depth: int = 0) -> tuple[set[str], dict[str, list[str]]]:
        """Attributes and methods (name -> parameter names) of a class and its bases."""
        attrs: set[str] = set()
        methods: dict[str, list[str]] = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                attrs.add(item.target.id)
            elif isinstance(item, ast.Assign):
                attrs |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = item.args
                methods[item.name] = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    attrs.add(item.name)
                for sub in ast.walk(item):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            attrs.add(t.attr)
        if depth < 8:
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) \
                    else None
                found = self.cls(module, name) if name else None
                if found is not None:
                    b_attrs, b_methods = self.members(found[0], found[1], depth=depth + 1)
                    attrs |= b_attrs
                    methods = {**b_methods, **methods}
        return attrs, methods


def check(root: str | Path, uses: tuple[Use, ...] = USES) -> list[str]:
    """Problems (one line each) of ``uses`` against the vLLM source tree at ``root`` (the folder holding
    ``vllm/``); empty when everything the plugin relies on is there."""
    tree = _Tree(Path(root))
    problems: list[str] = []
    for use in uses:
        mod = tree.module(use.module)
        if mod is None:
            problems.append(f"{use.module}: no such module ({use.why})")
            continue
        if use.cls is None:
            defs = {n.name: n for n in mod.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for name, params in use.functions:
                fn = defs.get(name)
                if fn is None:
                    problems.append(f"{use.module}.{name}: no such function ({use.why})")
                elif [a.arg for a in fn.args.args][:len(params)] != list(params):
                    problems.append(f"{use.module}.{name}: parameters {[a.arg for a in fn.args.args]}, "
                                    f"the plugin passes {list(params)}")
            continue
        found = tree.cls(use.module, use.cls)
        if found is None:
            problems.append(f"{use.module}.{use.cls}: no such class ({use.why})")
            continue
        attrs, methods = tree.members(*found)
        for name in use.attrs:
            if name not in attrs and name not in methods:
                problems.append(f"{use.module}.{use.cls}.{name}: no such attribute ({use.why})")
        for name, params in use.methods:
            if name not in methods:
                problems.append(f"{use.module}.{use.cls}.{name}(): no such method ({use.why})")
            elif missing := [p for p in params if p not in methods[name]]:
                problems.append(f"{use.module}.{use.cls}.{name}(): no parameter {', '.join(missing)}")
    return problems
