"""Tiny MoE checkpoints for real vLLM servers, built offline (random weights, no hub): a Qwen3-MoE, a Mixtral and
a DeepSeek-V3 (MLA, grouped sigmoid routing with correction bias), each saved with ``save_pretrained``
(safetensors) beside a byte-level BPE tokenizer (512 tokens, trained here in about a second on the text below, with
a ChatML chat template) that ``AutoTokenizer.from_pretrained(dir)`` and vLLM load.

    build(arch, out_dir, *, seed=0, hot=None, collapse_layer=None) -> Path   # one checkpoint folder
    build_all(out_dir) -> {arch: Path}                                      # healthy ones, out_dir/<arch>
    measure_routing(model_dir, text=HELD_OUT) -> {layer: [count per expert]}  # through HF, float32
    python tests/vllm_models.py OUTDIR                                       # builds all three, prints balance

Layers are numbered as vLLM numbers them: the decoder layer index N in ``model.layers.N`` (DeepSeek's layer 0 is
dense, ``first_k_dense_replace=1``, so its MoE layers start at 1). Each folder also holds ``moescope_build.json``:
the build arguments and the per-layer counts measured through HF on ``HELD_OUT`` at build time.

Balanced routers. Random tiny checkpoints route very unevenly (a few experts take 3-4x their fair share, others
none): the gate inputs share a large common direction (here on purpose: every embedding row carries one common
vector, as trained models' residual streams do) and are far from isotropic, so random gate rows give some experts
a constant head start. Each healthy gate is therefore calibrated, layer by layer in order (a layer's gate input
depends only on the gates before it), on ``CALIBRATION`` text run through the model in float32:
  1. collect the layer's gate inputs X, their mean mu and covariance S (shrunk towards its mean eigenvalue);
  2. gate rows W = R S^-1/2 with R random orthonormal rows orthogonal to S^-1/2 mu, so W mu = 0: each expert's
     logit has mean 0 and, with the whitening, about the same spread;
  3. 60 rounds on the collected X: Qwen3-MoE / Mixtral (softmax top-k, no gate bias) rescale each row by
     (fair / load)^0.3, DeepSeek-V3 moves ``e_score_correction_bias`` by 0.002 * sign(fair - load) (its own
     aux-loss-free balancing rule); the round with the lowest max/mean load is kept.
Measured through HF (float32), seed 0, per MoE layer: max/mean of the per-expert selection counts (1.0 is even;
the most an expert can reach is E/k: 4.0 here). On ``HELD_OUT`` (hand-written prose, code, JSON, notes, none of it
used for calibration; ~1,400 tokens) and on 8,300 tokens of fresh filler from the generator (seed 7, unseen):
    qwen3_moe   (8 experts, top-2, layers 0-3):            HELD_OUT 1.19 1.15 1.23 1.49   filler 1.08 1.17 1.14 1.13
    mixtral     (8 experts, top-2, layers 0-3):            HELD_OUT 1.17 1.08 1.29 1.35   filler 1.08 1.12 1.15 1.17
    deepseek_v3 (16 experts, 4 groups, topk_group 2, top-4; layer 0 dense, MoE layers 1-3):
                                                           HELD_OUT 1.67 1.77 1.25        filler 1.21 1.27 1.19
(On the calibration text itself every layer is at 1.00-1.01.) What remains is text dependence: a token's routing
is mostly fixed by its identity, so each frequent token is a lump of load, and a text whose token mix differs from
the calibration text loads experts differently; DeepSeek's group-limited top-4 is the lumpiest. Before
calibration (default init, with the common embedding direction) the same checkpoints measure 3.2-4.0 on every
MoE layer with some experts at 0.

Faults, real changes to the saved checkpoint, made after calibration:
  ``hot=(layer, expert, scale)``: that expert's gate row in that layer is multiplied by ``scale`` and given a
      component along the layer's mean gate input mu that lifts its mean logit by (scale - 1) standard deviations
      of its calibration logits (same rule for all three; DeepSeek's correction bias stays as calibrated).
  ``collapse_layer=L``: every gate row of layer L gets a large component along mu (+12 mean logit std for
      experts 0..k-1, -12 for the rest), so nearly every token goes to the same k experts.
Measured (HF float32, HELD_OUT, seed 0; the hot expert's count over the layer's mean count; other layers
unchanged from the healthy figures above, only layers after the fault move slightly):
    qwen3_moe   hot=(2, 3, 2.0): 2.01x   hot=(2, 3, 4.0): 2.73x   collapse_layer=2: experts 0,1 take 100% (4.0x)
    mixtral     hot=(2, 3, 2.0): 2.04x   hot=(2, 3, 4.0): 2.78x   collapse_layer=2: experts 0,1 take 100% (4.0x)
    deepseek_v3 hot=(2, 5, 2.0): 1.72x   hot=(2, 5, 4.0): 2.50x   collapse_layer=2: experts 0-3 take 100% (4.0x)
(DeepSeek's healthy layers reach 1.77 on HELD_OUT: use scale >= 4 there for a hot expert that stands out.)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, max_position_embeddings=2048,
               bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
CONFIGS = {
    "qwen3_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
                      moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=64,
                    num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
                        moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=64, v_head_dim=64, head_dim=64, num_nextn_predict_layers=0,
                        topk_method="noaux_tc", scoring_func="sigmoid"),
}
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}

_PROSE = """\
The river had risen overnight, and by morning the lower road was under a foot of brown water. Farmers led their
cattle up to the ridge while the children watched from the school steps, counting boats. Nobody expected the
bridge to hold, yet it did, groaning a little each time a tree trunk struck the pillars.
In 1887 the observatory bought a new telescope with a 36-inch lens. Astronomers used it to measure the orbits of
double stars, and one of them found a fifth moon of Jupiter, the first discovered since Galileo.
To bake bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise for
an hour, shape it, let it rise again, then bake it at 230 degrees for about thirty-five minutes.
Q: What is the capital of Australia? A: Canberra, not Sydney, although Sydney is the largest city.
Q: How many legs does a spider have? A: Eight. Insects have six.
The committee met on Tuesday to review the budget. Spending on roads rose by 4.2 percent, while the library
fund fell slightly. Several members asked why the audit had been delayed; the chair promised a report in May.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(i, fibonacci(i))
SELECT name, count(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name ORDER BY orders DESC;
{"id": 42, "status": "ok", "items": [1, 2, 3], "owner": {"name": "Ada", "email": "ada@example.org"}}
Dear Ms. Patel, thank you for your letter of 3 March. We have looked into the missing parcel and will send a
replacement by express post. Please accept our apologies for the trouble. Yours sincerely, the support team.
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the chloroplasts,
which contain chlorophyll, the green pigment that absorbs red and blue light.
- buy milk, eggs, and coffee
- call the plumber about the kitchen sink
- return the library books before Friday
The match ended 2-1 after a late goal from the visiting side. Their coach said the team had played with courage,
but admitted they were lucky the referee did not award a penalty in the first half.
Mountains cover most of the island. Its villages cling to the slopes, linked by narrow roads that close in
winter when snow blocks the passes, and the ferry is then the only way to reach the mainland.
"""
_HELD_OUT = """\
At dawn the fishing boats returned to the harbour, their decks heavy with silver herring. Gulls followed them
in, crying, and the market stalls opened one by one as the sun climbed over the old stone wall.
The new library opens on Monday at nine. Members may borrow up to twelve books, four films and two games at a
time; loans last three weeks and can be renewed twice online or at the front desk.
class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
Q: Why is the sky blue? A: Air scatters short blue wavelengths of sunlight more than long red ones.
Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains, where the air
pressure is lower; that is why pasta takes longer to cook in the Andes.
Meeting notes, 14 June: agreed to move the release to July 2; Sam will update the installer; Priya will write
the migration guide; open question: do we still support the 2019 file format?
She opened the letter slowly, recognised her grandmother's handwriting, and laughed at the first line.
{"temperature": 21.5, "humidity": 0.64, "wind": {"speed": 12, "direction": "NW"}, "alerts": []}
Trains to the airport leave every fifteen minutes from platform 4. The journey takes about twenty-five minutes
and tickets can be bought on board, although they cost more there than at the machines.
"""
_NOUNS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month book eye job word business side kind head house "
          "friend father power hour game line end member law car city name team minute idea body door health "
          "person war history party result change morning reason girl moment air teacher music market river road "
          "garden letter window kitchen train bridge village doctor table report field island engine").split()
_ADJS = ("good new first last long great little own other old right big high different small large next early "
         "young important few public bad same able late hard major better economic strong possible whole free "
         "quiet bright cold warm heavy clear simple narrow green empty busy").split()
_VERBS = ("said made went took came saw knew got gave found thought told became left felt brought began kept held "
          "wrote stood heard let meant set met ran paid sat spoke lay led read grew lost fell sent built").split()
_PREPS = "in on at with from into over after under near behind before through across about for".split()
_PRONS = "he she they we it I you".split()
_ADVS = "slowly quickly again today later soon already never always often quietly there here still".split()


def _generated(seed: int, n: int) -> str:
    """English-like filler with ordinary function-word frequencies (articles, pronouns, prepositions), some
    questions, dates, numbers, lists and code-like lines (deterministic for a seed)."""
    rng = random.Random(seed)
    c = rng.choice

    def np_():
        return f"{c(['the', 'the', 'a', 'this', 'that', 'his', 'her', 'their', 'our'])} " \
               f"{c(_ADJS) + ' ' if rng.random() < 0.4 else ''}{c(_NOUNS)}{'s' if rng.random() < 0.2 else ''}"

    out = []
    for _ in range(n):
        k = rng.random()
        if k < 0.6:
            s = f"{np_()} {c(_VERBS)} {np_()} {c(_PREPS)} {np_()}"
            if rng.random() < 0.5:
                s += f", {c(['and', 'but', 'so', 'because', 'while'])} {c(_PRONS)} {c(_VERBS)} {np_()} {c(_ADVS)}"
            out.append(s[0].upper() + s[1:] + c([".", ".", ".", "!", ";"]))
        elif k < 0.72:
            out.append(f"Q: {c(['What', 'Why', 'When', 'Where', 'How'])} did {np_()} {c(_VERBS)} {c(_PREPS)} "
                       f"{np_()}? A: {c(_PRONS).capitalize()} {c(_VERBS)} {np_()} {c(_ADVS)}.")
        elif k < 0.8:
            out.append(f"On {rng.randint(1, 28)} {c(['March', 'June', 'July', 'October', 'May'])} "
                       f"{rng.randint(1900, 2030)}, {np_()} cost {rng.randint(2, 999)}.{rng.randint(0, 99):02d} "
                       f"dollars and {rng.randint(2, 90)} percent of {np_()} {c(_VERBS)} it.")
        elif k < 0.9:
            out.append(f"- {c(_VERBS)} {np_()} {c(_PREPS)} {np_()}")
        else:
            a, b = c(_NOUNS), c(_NOUNS)
            out.append(c([f"{a}_{b} = {rng.randint(0, 999)}", f"if {a} > {b}:\n    return {a} + {rng.randint(1, 9)}",
                          f'{{"{a}": {rng.randint(0, 99)}, "{b}": "{c(_ADJS)}"}}']))
    return "\n".join(out) + "\n"


CALIBRATION = _PROSE + _generated(1, 500)
HELD_OUT = _HELD_OUT + _generated(2, 25)


# ---------------------------------------------------------------------------------------------------- tokenizer
def save_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CALIBRATION, HELD_OUT, _generated(3, 300)], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB and tok.token_to_id(SPECIALS[0]) == 0
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
                                   unk_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


# ---------------------------------------------------------------------------------------------------- model
EXPERTS_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}


def _config(arch: str, experts: int | None = None):
    from transformers import AutoConfig

    over = {} if experts is None else {EXPERTS_KEY[arch]: experts}
    cfg = AutoConfig.for_model(arch, **_COMMON, **{**CONFIGS[arch], **over})
    cfg.architectures = [ARCHITECTURES[arch]]
    return cfg


def moe_layers(model) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its router module} for the MoE layers (the same numbering vLLM uses)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out[i] = gate
    return out


def _top_k(model) -> int:
    return model.config.num_experts_per_tok


def _chunks(tokenizer, text: str, length: int = 64) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"]
    n = len(ids) // length
    return torch.tensor(ids[: n * length]).view(n, length)


@torch.no_grad()
def _gate_inputs(model, gate, batch: torch.Tensor) -> torch.Tensor:
    got = []
    h = gate.register_forward_pre_hook(lambda m, args: got.append(args[0].reshape(-1, args[0].shape[-1]).float()))
    try:
        model(input_ids=batch)
    finally:
        h.remove()
    return torch.cat(got)


def _route(gate, x: torch.Tensor) -> torch.Tensor:
    """Per-expert selection counts of ``gate`` on inputs x (the module's own forward: the HF routing rule)."""
    with torch.no_grad():
        ids = gate(x)[2]
    return torch.bincount(ids.reshape(-1), minlength=gate.num_experts).double()


@torch.no_grad()
def _balanced_rows(gate, x: torch.Tensor, sigmoid: bool, gen: torch.Generator):
    """One candidate: whitened random rows orthogonal to the mean input, then per-expert balancing on x."""
    e, d = gate.weight.shape
    mu = x.mean(0).double()
    xc = x.double() - mu
    cov = xc.T @ xc / len(x)
    cov = 0.7 * cov + 0.3 * torch.eye(d, dtype=torch.float64) * cov.diagonal().mean()  # shrinkage
    evals, evecs = torch.linalg.eigh(cov)
    inv_sqrt = evecs @ torch.diag(evals.clamp_min(1e-12).rsqrt()) @ evecs.T
    v = inv_sqrt @ mu
    v = v / v.norm()
    r = torch.randn(d, e, generator=gen, dtype=torch.float64)
    r = r - v[:, None] * (v @ r)[None, :]  # orthogonal to S^-1/2 mu
    q, _ = torch.linalg.qr(r)
    w = q.T @ inv_sqrt  # [e, d]: logits w x have mean 0 and unit spread per expert
    scale = torch.ones(e, dtype=torch.float64)
    bias = torch.zeros(e, dtype=torch.float32)
    fair = len(x) * gate.top_k / e
    best = (float("inf"), None, None)
    for _ in range(60):
        gate.weight.copy_((w * scale[:, None]).to(gate.weight.dtype))
        if sigmoid:
            gate.e_score_correction_bias.copy_(bias)
        load = _route(gate, x)
        if float(load.max() / fair) < best[0]:
            best = (float(load.max() / fair), gate.weight.clone(), bias.clone())
        if sigmoid:
            bias += 0.002 * torch.sign(fair - load).float()
        else:
            scale *= (fair / load.clamp_min(1.0)) ** 0.3
    return best[1], best[2]


@torch.no_grad()
def _calibrate(gate, x: torch.Tensor, sigmoid: bool, gen: torch.Generator) -> dict:
    w, bias = _balanced_rows(gate, x, sigmoid, gen)
    gate.weight.copy_(w)
    if sigmoid:
        gate.e_score_correction_bias.copy_(bias)
    return {"mu": x.mean(0).double(), "std": (x.double() @ gate.weight.double().T).std(0)}


@torch.no_grad()
def _tilt(gate, stats: dict, strength: float):
    """Expert e's logit raised by strength x (2e/(E-1) - 1) logit standard deviations for an input along the mean:
    a structural ramp of loads, every expert still in use."""
    mu, std = stats["mu"], stats["std"]
    e = gate.num_experts
    for i in range(e):
        ramp = 2.0 * i / (e - 1) - 1.0
        gate.weight[i] = (gate.weight[i].double() + strength * ramp * float(std.mean()) * mu / (mu @ mu)).to(
            gate.weight.dtype)


@torch.no_grad()
def _make_hot(gate, stats: dict, expert: int, scale: float):
    mu, std = stats["mu"], stats["std"]
    row = gate.weight[expert].double() * scale + (scale - 1.0) * float(std[expert]) * mu / (mu @ mu)
    gate.weight[expert] = row.to(gate.weight.dtype)


@torch.no_grad()
def _make_collapse(gate, stats: dict):
    mu, std = stats["mu"], stats["std"]
    shift = 12.0 * float(std.mean()) * mu / (mu @ mu)
    for e in range(gate.num_experts):
        sign = 1.0 if e < gate.top_k else -1.0
        gate.weight[e] = (gate.weight[e].double() + sign * shift).to(gate.weight.dtype)


def build(arch: str, out_dir: Path, *, seed: int = 0, hot: tuple[int, int, float] | None = None,
          collapse_layer: int | None = None, experts: int | None = None, uneven: float = 0.0) -> Path:
    """Builds one checkpoint (calibrated, balanced gates; then the faults asked for) into ``out_dir`` and returns it.
    ``experts``: another number of routed experts than the architecture's default here (CONFIGS). ``uneven``
    > 0: after calibration every gate row is tilted along the mean input by ``uneven`` x (a ramp from -1 to 1 over
    the experts) logit standard deviations, so every layer routes unevenly from the start, as trained models do (a
    healthy model whose unevenness is structure, not a fault); no fault goes with it."""
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out_dir)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = AutoModelForCausalLM.from_config(_config(arch, experts), dtype=torch.float32).eval()
    with torch.no_grad():  # a common direction in every embedding row, as trained models' residual streams have
        emb = model.model.embed_tokens.weight
        common = torch.randn(emb.shape[1], generator=gen)
        emb += common / common.norm() * emb.norm(dim=1).mean()
    gates = moe_layers(model)
    for layer in ([hot[0]] if hot else []) + ([collapse_layer] if collapse_layer is not None else []):
        if layer not in gates:
            raise ValueError(f"layer {layer} is not an MoE layer of {arch}; MoE layers: {sorted(gates)}")
    if uneven and (hot is not None or collapse_layer is not None):
        raise ValueError("an uneven checkpoint is a healthy one: it takes no fault")
    batch = _chunks(tokenizer, CALIBRATION)
    stats = {}
    for layer, gate in gates.items():  # in order: a gate's inputs depend only on the gates before it
        stats[layer] = _calibrate(gate, _gate_inputs(model, gate, batch), arch == "deepseek_v3", gen)
        if uneven:
            _tilt(gate, stats[layer], uneven)
    if hot is not None:
        layer, expert, scale = hot
        _make_hot(gates[layer], stats[layer], int(expert), float(scale))
    if collapse_layer is not None:
        _make_collapse(gates[collapse_layer], stats[collapse_layer])
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    counts = _measure(model, tokenizer, HELD_OUT)
    report = {"arch": arch, "seed": seed, "experts": experts, "uneven": uneven, "hot": list(hot) if hot else None,
              "collapse_layer": collapse_layer,
              "top_k": _top_k(model), "held_out_counts": counts, "max_over_mean": _max_over_mean(counts)}
    (out_dir / "moescope_build.json").write_text(json.dumps(report, indent=1))
    return out_dir


def build_all(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    return {arch: build(arch, Path(out_dir) / arch, seed=seed) for arch in ARCHS}


# ---------------------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def _measure(model, tokenizer, text: str) -> dict[int, list[int]]:
    counts = {}
    hooks = [gate.register_forward_hook(
        lambda m, a, out, layer=layer: counts.__setitem__(
            layer, counts.get(layer, 0) + torch.bincount(out[2].reshape(-1), minlength=m.num_experts)))
        for layer, gate in moe_layers(model).items()]
    try:
        for row in _chunks(tokenizer, text, 128):
            model(input_ids=row[None])
    finally:
        for h in hooks:
            h.remove()
    return {layer: c.tolist() for layer, c in sorted(counts.items())}


def _max_over_mean(counts: dict[int, list[int]]) -> dict[int, float]:
    return {layer: round(max(c) / (sum(c) / len(c)), 3) for layer, c in counts.items()}


def measure_routing(model_dir: Path, text: str = HELD_OUT) -> dict[int, list[int]]:
    """Per MoE layer, how many tokens of ``text`` each expert received, through HF in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _measure(model, AutoTokenizer.from_pretrained(model_dir), text)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for arch, path in build_all(root).items():
        print(arch, path, _max_over_mean(measure_routing(path)))
