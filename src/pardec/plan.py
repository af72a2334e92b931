"""Per-GPU memory plan of a paper recipe, from its real architecture on the meta device (no weights, no network).

    python -m pardec.plan <recipe> [<recipe> ...] [--all] [--json out.json] [--world N] [--gpus N]

A recipe is a training experiment (``conf/experiment/<name>.yaml``, composed as ``python -m train
+experiment=<name>`` composes it) or an evaluation recipe (``conf/recipe/<name>.yaml``, as ``python -m evaluate
+recipe=<name>``). The model is built from the ``config.json`` shipped under ``conf/model_configs/<hub id with / as
__>/`` with ``AutoModelForCausalLM.from_config`` on the meta device; parameters are counted by summing ``numel()``.
Configs are composed as on a CUDA machine (``dtype`` and ``trainer.bf16`` take their GPU defaults).

Every figure is in GB = 1e9 bytes, per GPU (the busiest one), for the recipe's train stage (training) or its
decoding run (evaluation). Components (docs/plan.md has the derivations and their sources):

* weights: the trained module in the training dtype (bf16 when DeepSpeed runs with ``trainer.bf16``: the engine
  casts its module; else ``trainer.model_dtype``), replicated except under ZeRO-3 (``/ world``). Evaluation: the
  target's share (``/ gpus`` under ``model.device_map``) plus the draft;
* grads: trainable parameters x training-dtype bytes, ``/ world`` under ZeRO-2/3;
* optimizer: Adam, per trainable parameter fp32 m + v (8 B) plus fp32 master weights (4 B) when the training dtype
  is 16-bit or DeepSpeed runs (its partitions are fp32): 12 B; ``/ world`` under ZeRO-2/3;
* gathered: ZeRO-3's all-gathered parameters, at most ``stage3_max_live_parameters`` (conf/deepspeed/zero3.json)
  x training-dtype bytes (an upper bound);
* frozen: the frozen teacher (kind draft, ``trainer.teacher=online``) or base (kind heads) in the run's ``dtype``,
  on every rank (outside the DeepSpeed engine);
* activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2):
  one layer keeps ``s b h (34 + 5 a s / h)`` bytes at 16-bit (scaled by bytes/2 otherwise); the ``5 a s^2 b``
  attention-score term is dropped under ``attn_implementation`` sdpa / flash (scores never materialised). With
  gradient checkpointing each layer keeps only its input (``s b h x bytes``) plus one layer's full footprint
  during recomputation. Evaluation: one layer's transient working set over the prompt;
* logits: fp32 (4 B) logits for the loss over every trained position, plus the teacher's where the kind distils
  (Medusa / FIRP: K student rows per position). Evaluation: the perplexity pass over the whole context;
* kv: evaluation's KV cache, ``2 x layers x kv_heads x head_dim x bytes`` per token over ``max prompt tokens +
  max_new_tokens + 64`` (target ``/ gpus``; the draft's x ``method.num_beams``); FIRP training: the real tokens'
  K/V of the frozen base that the pseudo states attend to;
* overhead: 10% of the rest (CUDA context, allocator fragmentation, NCCL buffers), its own column.

``fits`` compares the total with 40 / 80 / 141 GB (nominal sizes in 1e9 bytes: conservative, a 40 GiB card holds
42.9 GB). A target split with ``model.device_map`` that does not fit at ``--gpus`` shows how many GPUs of that size
would hold it ("2 GPUs"). Not planned: data-generation stages (collect / generate / mask), CPU recipes.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.recipes import (
    MODEL_CONFIGS,
    TRAINED_PATH,
    hub_id,
    option,
    recipes,
    shipped_config,
    trained_experiment,
)
from pardec.registry import Registry, UnknownNameError

GB = 1e9
CAPACITIES_GB = (40, 80, 141)
OVERHEAD = 0.10
DEFAULT_WORLD = 8  # training ranks when a recipe documents no `--nproc_per_node N`
MAX_GPUS = 8  # the most GPUs a device_map split is tried over for the fits columns
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CONTEXT_MARGIN = 64  # tokens of draft window / verification rows on top of prompt + max_new_tokens
#: longest prompt of each task in tokens (an estimate from the task's prompt, conservative; --prompt-tokens overrides)
PROMPT_TOKENS = {"humaneval": 600, "wmt16": 256, "mt_bench": 512, "spider": 1024, "sharegpt": 1024,
                 "code_search_net": 256, "python_docstrings": 256}
COMPONENTS = ("weights", "grads", "optimizer", "gathered", "frozen", "activations", "logits", "kv", "overhead")


@dataclass
class Arch:
    """A model's shape, counted on its meta-device build."""

    hub_id: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool = True  # a gated (SwiGLU) MLP: gate and up projections

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass
class Plan:
    """One recipe's per-GPU memory (``components`` in bytes)."""

    recipe: str
    kind: str  # cllm | draft | heads | sdsat (training) | eval
    world: int  # training ranks; evaluation: GPUs the target is split over
    zero: int | None  # ZeRO stage (0 = plain DDP); None for evaluation
    model: str
    params: int  # the target's parameter count
    trainable: int
    components: dict[str, float]
    notes: list[str] = field(default_factory=list)
    gpus_needed: dict[int, int | None] = field(default_factory=dict)  # device_map splits: GPUs per capacity

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def fits(self, capacity_gb: float) -> bool:
        return self.total <= capacity_gb * GB

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["components_gb"] = {k: round(v / GB, 3) for k, v in out.pop("components").items()}
        out["total_gb"] = round(self.total / GB, 3)
        out["fits"] = {str(c): self.fits(c) for c in CAPACITIES_GB}
        out["gpus_needed"] = {str(c): n for c, n in self.gpus_needed.items()}
        return out


# ------------------------------------------------------------------------------------------- recipes
def _trained_hub(path: str | None) -> str | None:
    """The hub id of the model a training experiment (named in ``path``, :data:`~pardec.recipes.TRAINED_PATH`)
    starts from: a model it trains keeps that architecture (CLLM, SDSAT), so the plan reads that model's
    config.json."""
    m = TRAINED_PATH.search(path or "")
    return hub_id(option(m.group(1), "model")) if m and recipes().get(m.group(1)) == "train" else None


def _recipe_hub(name: str) -> str | None:
    """The hub id of a recipe's model, without composing: its model config's, or the architecture of the run dir it
    reads (an evaluation recipe of a trained model)."""
    hub = hub_id(option(name, "model"))
    if hub is None and recipes()[name] == "evaluate" and (exp := trained_experiment(name)):
        hub = hub_id(option(exp, "model"))
    return hub


def paper_recipes() -> list[str]:
    """The recipes whose model has a shipped config.json: every evaluation recipe and the GPU-scale experiments
    (the CPU-sized ones train tiny_random / SmolLM2 and are not planned)."""
    return [n for n in recipes() if (h := _recipe_hub(n)) and shipped_config(h).is_file()]


def matching(patterns: Sequence[str]) -> list[str]:
    """Training recipes whose name matches any of the glob ``patterns`` (e.g. ``*7b*``)."""
    return [n for n, app in recipes().items() if app == "train" and any(fnmatch.fnmatch(n, p) for p in patterns)]


def check_name(name: str) -> str:
    reg: Registry[str] = Registry("recipe")
    for n, app in recipes().items():
        reg.add(n, app)
    try:
        return reg.canonical(name)
    except UnknownNameError as e:
        raise ConfigError(str(e)) from None


def launch_world(name: str) -> int:
    """The ``--nproc_per_node N`` of a training recipe's documented launch line, else DEFAULT_WORLD."""
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    m = re.search(r"--nproc_per_node[ =](\d+)", text)
    return int(m.group(1)) if m else DEFAULT_WORLD


@contextlib.contextmanager
def _as_on_cuda() -> Iterator[None]:
    """Resolve the GPU defaults (``dtype`` bf16, ``trainer.bf16`` true) whatever this machine has."""
    import torch

    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # what pardec.on_cuda() asks; only while the values resolve
    try:
        yield
    finally:
        torch.cuda.is_available = saved


def compose(name: str, overrides: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """(``train`` | ``evaluate``, the recipe's composed config as a plain dict, GPU defaults; no hydra keys)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    name = check_name(name)
    app = recipes()[name]
    key = "experiment" if app == "train" else "recipe"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(app, overrides=[f"+{key}={name}", *overrides])
        except HydraException as e:  # a bad --set: one line
            raise ConfigError(f"recipe {name!r} with {list(overrides)}: {' '.join(str(e).split())}") from None
    keep = ("model", "draft", "dataset", "dtype", "max_new_tokens", "method", "trainer", "kind", "heads", "collect",
            "perplexity")
    with _as_on_cuda():
        return app, {k: _plain(cfg, k) for k in keep if k in cfg}


def _plain(cfg, key: str) -> Any:
    """``cfg[key]`` as plain Python, resolved leaf by leaf; a leaf that cannot resolve outside a Hydra run (the run
    dir, ``${hydra:...}``) becomes None: the plan never reads one."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    if isinstance(node, DictConfig):
        return {str(k): _plain(cfg, f"{key}.{k}") for k in node.keys()}
    if isinstance(node, ListConfig):
        return [_plain(cfg, f"{key}[{i}]") for i in range(len(node))]
    return node


# ------------------------------------------------------------------------------------------- architectures
@functools.cache
def _meta_model(hub_id: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = shipped_config(hub_id)
    if not path.is_file():
        raise ConfigError(f"no config.json for {hub_id!r}: add the hub's config.json as {path}")
    cfg = AutoConfig.from_pretrained(str(path.parent))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def arch(hub_id: str) -> Arch:
    model = _meta_model(hub_id)
    c = model.config
    heads = c.num_attention_heads
    return Arch(hub_id=hub_id, params=sum(p.numel() for p in model.parameters()), layers=c.num_hidden_layers,
                hidden=c.hidden_size, heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                intermediate=c.intermediate_size, vocab=c.vocab_size,
                gated=any(n.endswith("mlp.gate_proj.weight") for n, _ in model.named_parameters()))


def lora_params(hub_id: str, r: int, targets: Sequence[str]) -> int:
    """LoRA adapter parameters: ``r x (in + out)`` for every Linear whose name ends in a target module."""
    from torch import nn

    return sum(r * (m.in_features + m.out_features) for n, m in _meta_model(hub_id).named_modules()
               if isinstance(m, nn.Linear) and n.split(".")[-1] in set(targets))


def draft_params(hub_id: str, layers: int, vocab_size: int, freeze_embeddings: bool) -> tuple[int, int]:
    """(all, trainable) parameters of kind draft's student: ``layers`` of the target's decoder layers, its embeddings
    and a head over ``vocab_size`` kept ids (:class:`pardec.models.draft.DraftForCausalLM`, built on the meta device)."""
    import torch

    from pardec.models.draft import DraftConfig, DraftForCausalLM

    t = _meta_model(hub_id).config.to_dict()
    for k in ("model_type", "architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        t.pop(k, None)
    t["num_hidden_layers"] = layers
    with torch.device("meta"):
        student = DraftForCausalLM(DraftConfig(**t, draft_vocab=list(range(vocab_size))))
    total = sum(p.numel() for p in student.parameters())
    frozen = student.model.embed_tokens.weight.numel() if freeze_embeddings else 0
    return total, total - frozen


def drafter_params(hub_id: str, heads: dict[str, Any]) -> int:
    """Medusa heads / FIRP projections / an EAGLE-3 or DFlash draft (:func:`pardec.models.heads.new_drafter`, built
    on the meta device)."""
    import torch

    from pardec.models.heads import new_drafter
    from pardec.models.vocab import DraftVocab

    cfg = _meta_model(hub_id).config
    kind = heads["type"]
    with torch.device("meta"):
        if kind == "dflash":
            d = new_drafter("dflash", cfg, layers=heads.get("layers"), dflash={
                k: heads[k] for k in ("num_layers", "block_size", "mask_token_id", "fusion") if k in heads})
        elif kind == "eagle3":
            size = int(heads.get("draft_vocab_size", cfg.vocab_size))
            d = new_drafter("eagle3", cfg, layers=heads.get("layers"), vocab=DraftVocab(range(size), cfg.vocab_size))
        else:
            d = new_drafter(kind, cfg, num_heads=heads.get("num_heads", 3), num_blocks=heads.get("num_blocks", 1),
                            layers=heads.get("layers"), attention=heads.get("attention", "real"))
    return sum(p.numel() for p in d.parameters())


# ------------------------------------------------------------------------------------------- formulas
def layer_activations(tokens: int, seq: int, a: Arch, act_bytes: int, eager: bool) -> float:
    """One transformer layer's saved activations (Korthikanti et al. 2022, eq. 2: ``s b h (34 + 5 a s / h)`` bytes at
    16-bit), ``tokens`` = b x s; the ``5 a s^2 b`` score term only under eager attention. The 34 is attention 11 +
    two norms 4 + a 4h GELU MLP 19 (its input 2, GELU input and output 8 + 8, dropout mask 1); a gated MLP of width
    i keeps its input 2h, the gate's output, SiLU's output, the up projection's output and their product (the
    down projection's input) 4 x 2i, and no dropout mask: 17h + 8i in all (Llama-2-7B 1.13x the 34h, Llama-3.1-8B
    1.32x)."""
    per_token = (17 * a.hidden + 8 * a.intermediate if a.gated else 34 * a.hidden) + (5 * a.heads * seq if eager else 0)
    return tokens * per_token * act_bytes / 2


#: the peak of a loss's forward + backward over its logits, beyond the logits themselves, in fp32 copies of those
#: logits: measured with pardec.metrics.memory at [2, 256, 8192] on the CPU, the same for fp32 and bf16 logits (the
#: fp32 log-softmax, its gradient and the logits' gradient: 3; the smoothed CE's mean term one more; the KL the
#: teacher's log-softmax and its exponent two more). A training step's after the first: the first call of a process
#: also holds one-time buffers (up to 1.5 copies more). tests/test_plan.py re-measures every entry with the real code
LOSS_PEAK = {
    "ce": 3.0,            # pardec.training.losses.ar_loss (a hard-label CE)
    "ce_smoothed": 4.0,   # ar_loss with label smoothing (CLLM's AR term, epsilon 0.1)
    "ce_sum": 3.0,        # ce_sum over selected positions (SDSAT Eq. 9)
    "kl": 5.0,            # token_divergence, KL to a teacher's logits (CLLM consistency, draft, Medusa / FIRP)
    "soft_ce": 3.0,       # EAGLE-3's CE to the target's probabilities per TTT step (training/heads/eagle.soft_ce)
    "dflash": 3.0,        # DFlash's slot log-softmax, gather and argmax (training/heads/dflash.slot_nll)
}


def loss_logits(rows: int, vocab: int, loss: str, logit_bytes: int) -> float:
    """Bytes of ``rows`` positions' logits over ``vocab`` in ``logit_bytes`` and their loss's peak
    (:data:`LOSS_PEAK`)."""
    return rows * vocab * (logit_bytes + 4 * LOSS_PEAK[loss])


def stack_activations(n_layers: int, tokens: int, seq: int, a: Arch, act_bytes: int, eager: bool,
                      checkpointing: bool) -> float:
    if n_layers <= 0:
        return 0.0
    full = layer_activations(tokens, seq, a, act_bytes, eager)
    if checkpointing:  # each layer keeps its input; one layer is recomputed at a time
        return n_layers * tokens * a.hidden * act_bytes + full
    return n_layers * full


def _zero_stage(deepspeed: str | None) -> int:
    if not deepspeed:
        return 0
    path = CONF_DIR / "deepspeed" / f"{deepspeed}.json"
    if not path.is_file():
        raise ConfigError(f"trainer.deepspeed={deepspeed!r}: no {path}")
    return int(json.loads(path.read_text())["zero_optimization"]["stage"])


def _max_live() -> float:
    z3 = json.loads((CONF_DIR / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    return float(z3.get("stage3_max_live_parameters", 1e9))


# ------------------------------------------------------------------------------------------- plans
def plan(name: str, *, world: int | None = None, gpus: int | None = None, overrides: Sequence[str] = (),
         prompt_tokens: int | None = None) -> Plan:
    """The per-GPU memory plan of recipe ``name`` (training: ``world`` ranks, default its launch line's; evaluation:
    the target split over ``gpus`` GPUs under ``model.device_map``, default 1)."""
    name = check_name(name)
    app, cfg = compose(name, overrides)
    model = cfg["model"]
    hub = model.get("path") if model.get("source") == "hub" else _trained_hub(model.get("path"))
    if hub is None or not shipped_config(hub).is_file():
        where = shipped_config(hub).relative_to(CONF_DIR.parent) if hub else f"source {model.get('source')}"
        raise ConfigError(f"recipe {name!r} runs model {model.get('name')!r} ({where}), which has no shipped "
                          f"config.json; the plan covers the paper recipes: {', '.join(paper_recipes())}")
    if app == "train":
        return _train_plan(name, cfg, world or launch_world(name))
    return _eval_plan(name, cfg, gpus or 1, prompt_tokens)


def _hub_of(section: dict[str, Any], where: str) -> str:
    if section.get("source") == "local" and (hub := _trained_hub(section.get("path"))):
        return hub
    if section.get("source") != "hub" or not section.get("path"):
        raise ConfigError(f"{where}={section.get('name')!r} is not a hub model: the plan needs a config.json under "
                          f"{MODEL_CONFIGS}")
    return section["path"]


def _train_plan(name: str, cfg: dict[str, Any], world: int) -> Plan:
    kind, t = cfg["kind"], cfg["trainer"]
    hub = _hub_of(cfg["model"], "model")
    a = arch(hub)
    zero = _zero_stage(t.get("deepspeed"))
    bf16 = bool(t.get("bf16")) or bool(t.get("fp16"))
    train_bytes = 2 if (zero and bf16) else DTYPE_BYTES[t.get("model_dtype", "fp32")]  # DeepSpeed casts its module
    act_bytes = 2 if bf16 else train_bytes
    run_bytes = DTYPE_BYTES[cfg["dtype"]]
    eager = cfg["model"].get("attn_implementation") == "eager"
    ckpt = bool(t.get("gradient_checkpointing"))
    b, seq = int(t.get("per_device_train_batch_size", 1)), int(t.get("max_length", 1024))
    notes: list[str] = []
    frozen = activations = logits = kv = 0.0
    lora = t.get("lora") or {}

    if kind in ("cllm", "sdsat"):  # the target itself is trained
        module = a.params
        trainable = module
        if lora.get("enabled"):
            trainable = lora_params(hub, int(lora.get("r", 16)), lora.get("target_modules") or [])
            notes.append(f"LoRA r={lora.get('r', 16)} on {','.join(lora.get('target_modules') or [])}")
        if kind == "cllm":  # one packed sequence: the AR row (<= max_length) + states (+ augmented copy) of a block
            block = int((cfg.get("collect") or {}).get("block_size", 16))
            states = int(t.get("states_per_sample", 1)) + (1 if t.get("loss_type", "global") == "global" else 0)
            seq = seq + states * block
            rows = b
        else:  # sdsat: each record is two rows (plain + masked)
            rows = 2 * b
        activations = stack_activations(a.layers, rows * seq, seq, a, act_bytes, eager, ckpt)
        # CLLM: the consistency KL and the smoothed AR CE over one graph (the KL's peak bounds both); SDSAT: ce_sum
        logits = loss_logits(rows * seq, a.vocab, "kl" if kind == "cllm" else "ce_sum", act_bytes)
    elif kind == "draft":
        d = cfg.get("draft") or {}
        n_layers, vocab = len(d.get("layers") or []), int(d.get("vocab_size", a.vocab))
        module, trainable = draft_params(hub, n_layers, vocab, bool(d.get("freeze_embeddings", True)))
        if t.get("teacher", "online") == "online":
            frozen = a.params * run_bytes
        activations = stack_activations(n_layers, b * seq, seq, a, act_bytes, eager, ckpt)
        logits = loss_logits(b * seq, vocab, "kl", act_bytes) + (b * seq * a.vocab * run_bytes if frozen else 0)
        notes.append(f"student: {n_layers} layers, {vocab}-token head")
    elif kind == "heads":  # trainer.model_dtype is the frozen base's here; the drafter is built in fp32
        h = cfg.get("heads") or {}
        module = trainable = drafter_params(hub, h)
        train_bytes = 2 if (zero and bf16) else 4
        act_bytes = 2 if bf16 else 4
        run_bytes = DTYPE_BYTES[t.get("model_dtype") or cfg["dtype"]]
        frozen = a.params * run_bytes
        tokens = b * seq
        if h.get("type") == "medusa":
            k = int(h.get("num_heads", 3))
            # the base runs without gradients; each head's ResBlocks keep input, pre-activation and SiLU output
            activations = tokens * a.hidden * act_bytes * (1 + 3 * k * int(h.get("num_blocks", 1)))
        elif h.get("type") == "dflash":
            # num_anchors blocks of block_size queries per sequence through the draft's layers, each over the
            # sequence's context keys/values plus the blocks'; fp32 logits of every predicted slot over the
            # target's vocabulary (the shared head), and the base's logits (its forward returns them)
            n, blk = int(h.get("num_layers", 5)), int(h.get("block_size", 16))
            queries = b * min(int(h.get("num_anchors", 512)), seq) * blk
            activations = stack_activations(n, queries, seq + queries // b, a, act_bytes, eager, ckpt)
            kv = tokens * n * 2 * a.kv_heads * a.head_dim * act_bytes  # every layer's context keys/values
            k = blk - 1
            logits = loss_logits(queries, a.vocab, "dflash", act_bytes) + tokens * a.vocab * run_bytes
            notes.append(f"dflash drafter, {n} layers, {queries // b} block slots per sequence")
        elif h.get("type") == "eagle3":
            # one layer of 2H input unrolled ttt_steps times over every position; the target's logits once, the
            # draft's over its vocabulary per step
            k = int(h.get("ttt_steps", 7))
            activations = stack_activations(k, tokens, seq * k, a, act_bytes, eager, ckpt)
            draft_vocab = int(h.get("draft_vocab_size", a.vocab))
            logits = (tokens * a.vocab * run_bytes + tokens * draft_vocab * 4  # the base's, its fp32 log-softmax
                      + loss_logits(k * tokens, draft_vocab, "soft_ce", act_bytes))
            notes.append(f"eagle3 drafter, {k} TTT steps")
        else:  # firp: pseudo states of projection i run through layers t_i..L-1 with gradients
            layers = [int(x) for x in h.get("layers") or []]
            k = len(layers)
            passes = sum(a.layers - x for x in layers)
            activations = (stack_activations(passes, tokens, seq, a, act_bytes, eager, ckpt)
                           - (layer_activations(tokens, seq, a, act_bytes, eager) if ckpt else 0)
                           + (layer_activations(k * tokens, seq, a, act_bytes, eager) if ckpt else 0))
            kv = tokens * a.kv_bytes_per_token(run_bytes)  # the real tokens' K/V the pseudo states attend to
        if h.get("type") in ("medusa", "firp"):
            # K student rows (each depth's KL to the base's row) + the base's row per position
            logits = loss_logits(k * tokens, a.vocab, "kl", act_bytes) + tokens * a.vocab * run_bytes
            notes.append(f"{h.get('type')} drafter, K={k}")
    else:
        raise ConfigError(f"recipe {name!r}: kind {kind!r} has no memory model in pardec.plan")

    master = 12 if (zero or train_bytes < 4) else 8  # fp32 m + v (+ fp32 master weights)
    comps = dict.fromkeys(COMPONENTS, 0.0)
    comps["weights"] = module * train_bytes / (world if zero == 3 else 1)
    # DeepSpeed's own estimates (estimate_zero2/3_model_states_mem_needs): ZeRO-2 keeps 16-bit and fp32 gradient
    # partitions (2 + 4 B / world), ZeRO-3 4 B / world; plain DDP the gradients whole
    comps["grads"] = trainable * {0: train_bytes, 1: train_bytes, 2: (train_bytes + 4) / world, 3: 4 / world}[zero]
    comps["optimizer"] = trainable * master / (world if zero else 1)
    comps["gathered"] = min(_max_live(), module) * train_bytes if zero == 3 else 0.0
    comps.update(frozen=frozen, activations=activations, logits=logits, kv=kv)
    comps["overhead"] = OVERHEAD * sum(comps.values())
    if ckpt:
        notes.append("gradient checkpointing")
    return Plan(recipe=name, kind=kind, world=world, zero=zero, model=hub, params=a.params, trainable=trainable,
                components=comps, notes=notes)


def prompt_estimate(dataset: dict[str, Any]) -> int:
    name, extra = dataset.get("name"), dataset.get("extra") or {}
    if name == "gsm8k":
        return 300 + 150 * int(extra.get("num_fewshot", 0) or 0)
    if name == "cnn_dm":
        return int(1.5 * int(extra.get("max_article_words", 400))) + 64
    return PROMPT_TOKENS.get(name, 1024)


def _eval_plan(name: str, cfg: dict[str, Any], gpus: int, prompt_tokens: int | None) -> Plan:
    model, draft, method = cfg["model"], cfg.get("draft") or {}, cfg.get("method") or {}
    a = arch(_hub_of(model, "model"))
    split = bool(model.get("device_map"))
    gpus = gpus if split else 1
    t_bytes = DTYPE_BYTES[model.get("dtype") or cfg["dtype"]]
    prompt = prompt_tokens or prompt_estimate(cfg.get("dataset") or {})
    context = prompt + int(cfg.get("max_new_tokens", 256)) + CONTEXT_MARGIN
    weights = a.params * t_bytes
    kv = context * a.kv_bytes_per_token(t_bytes)
    draft_w = draft_kv = 0.0
    notes = [f"context {context} tokens (prompt ~{prompt} + {cfg.get('max_new_tokens')} new + {CONTEXT_MARGIN})"]
    if draft.get("name"):
        d = arch(_hub_of(draft, "draft"))
        d_bytes = DTYPE_BYTES[draft.get("dtype") or cfg["dtype"]]
        draft_w = d.params * d_bytes
        draft_kv = context * d.kv_bytes_per_token(d_bytes) * int(method.get("num_beams", 1) or 1)
        notes.append(f"draft {d.hub_id} ({d.params / 1e9:.2f}B) on the first GPU")
    per_gpu = _eval_components(weights, kv, draft_w, draft_kv, a, prompt, context, t_bytes, gpus,
                               bool((cfg.get("perplexity") or {}).get("enabled", True)))
    p = Plan(recipe=name, kind="eval", world=gpus, zero=None, model=a.hub_id, params=a.params, trainable=0,
             components=per_gpu, notes=notes)
    if split:
        notes.append(f"model.device_map={model['device_map']}: target split over {gpus} GPU(s)")
        for cap in CAPACITIES_GB:
            p.gpus_needed[cap] = next((g for g in range(1, MAX_GPUS + 1) if sum(_eval_components(
                weights, kv, draft_w, draft_kv, a, prompt, context, t_bytes, g,
                bool((cfg.get("perplexity") or {}).get("enabled", True))).values()) <= cap * GB), None)
    return p


def _eval_components(weights: float, kv: float, draft_w: float, draft_kv: float, a: Arch, prompt: int, context: int,
                     t_bytes: int, gpus: int, perplexity: bool) -> dict[str, float]:
    """The busiest GPU (the first: its share of the target plus the draft and the working buffers)."""
    comps = dict.fromkeys(COMPONENTS, 0.0)
    comps["weights"] = weights / gpus + draft_w
    comps["kv"] = kv / gpus + draft_kv
    comps["activations"] = prompt * (4 * a.hidden + 3 * a.intermediate) * t_bytes  # one layer over the prompt
    comps["logits"] = (context if perplexity else 64) * a.vocab * 4
    comps["overhead"] = OVERHEAD * sum(comps.values())
    return comps


# ------------------------------------------------------------------------------------------- output
_HEAD = ("recipe", "kind", "world", "ZeRO", "params") + tuple(c if c != "optimizer" else "optim" for c in COMPONENTS) \
    + ("total",) + tuple(f"{c}GB" for c in CAPACITIES_GB)


def _fit_cell(p: Plan, cap: int) -> str:
    if p.fits(cap):
        return "yes"
    n = p.gpus_needed.get(cap)
    return f"{n} GPUs" if n and n > p.world else "no"


def table_rows(plans: Sequence[Plan]) -> list[tuple[str, ...]]:
    return [(p.recipe, p.kind, str(p.world), "-" if p.zero is None else str(p.zero), f"{p.params / 1e9:.2f}B",
             *(f"{p.components[c] / GB:.1f}" for c in COMPONENTS), f"{p.total / GB:.1f}",
             *(_fit_cell(p, c) for c in CAPACITIES_GB)) for p in plans]


def table(plans: Sequence[Plan]) -> str:
    rows = [_HEAD, *table_rows(plans)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    from pardec.config import exit_with_error

    parser = argparse.ArgumentParser(
        prog="python -m pardec.plan", description=__doc__.splitlines()[0],
        epilog="GB = 1e9 bytes, per GPU; overhead = 10% of the components. Formulas: docs/plan.md.")
    parser.add_argument("recipes", nargs="*", help="conf/experiment/<name> or conf/recipe/<name> (no extension)")
    parser.add_argument("--all", action="store_true", help="every paper recipe (those with a shipped config.json)")
    parser.add_argument("--json", metavar="OUT", help="also write the plans to this JSON file")
    parser.add_argument("--result", metavar="FILE#NAME",
                        help="also keep the table as table NAME of the result file FILE (created, or added to), with "
                             "its command, commit and date: what docs/plan.md's tables are rendered from")
    parser.add_argument("--world", type=int, help="training ranks (default: the recipe's --nproc_per_node, else 8)")
    parser.add_argument("--gpus", type=int, help="evaluation: GPUs a model.device_map target is split over (default 1)")
    parser.add_argument("--prompt-tokens", type=int, help="evaluation: longest prompt in tokens (default: per task)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for the composed recipe, e.g. trainer.deepspeed=zero3 (repeatable)")
    args = parser.parse_args(argv)
    try:
        names = list(args.recipes) + (paper_recipes() if args.all else [])
        if not names:
            parser.error("name at least one recipe, or --all")
        for n in names:
            check_name(n)
        plans = [plan(n, world=args.world, gpus=args.gpus, overrides=args.set, prompt_tokens=args.prompt_tokens)
                 for n in dict.fromkeys(names)]
    except ConfigError as e:
        exit_with_error(e)
    print(table(plans))
    print(f"\nper GPU, GB = 1e9 bytes; overhead = {OVERHEAD:.0%} of the rest (CUDA context, fragmentation); "
          "eval rows: world = GPUs the target is split over (model.device_map), the first GPU also holds the draft")
    if args.json:
        Path(args.json).write_text(json.dumps([p.to_json() for p in plans], indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.result:
        keep_result(args.result, plans, ["python", "-m", "pardec.plan", *(argv if argv is not None else sys.argv[1:])])
        print(f"wrote {args.result}")


def keep_result(ref: str, plans: Sequence[Plan], command: Sequence[str]) -> None:
    """Table ``NAME`` of result file ``FILE`` (``FILE#NAME``): the rows, the command and the commit it came from; the
    file's other tables are kept (one file holds a page's tables, each with its own command)."""
    import shlex
    import subprocess
    from datetime import date

    path, _, name = ref.partition("#")
    if not name:
        raise SystemExit(f"--result {ref!r}: give FILE#NAME (the table's name in the file)")
    out = Path(path)
    data = json.loads(out.read_text()) if out.is_file() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    data.update({"title": "Memory plans of the paper recipes: python -m pardec.plan (per GPU, GB = 1e9 bytes; "
                          "estimates from the formulas of docs/plan.md, their loss factors measured)",
                 "date": date.today().isoformat(), "host": "any: each model's architecture is built on the meta "
                 "device from the shipped config.json (no weights, no GPU)",
                 "dtype": "bf16 (the recipes' GPU defaults: dtype bf16, trainer.bf16)", "n": None,
                 "transcribed": False})
    data.setdefault("tables", {})[name] = {"command": shlex.join(command), "commit": commit,
                                           "columns": list(_HEAD), "rows": [list(r) for r in table_rows(plans)],
                                           "plans": [p.to_json() for p in plans]}
    data["command"] = "; ".join(t["command"] for t in data["tables"].values())
    data["commit"] = ", ".join(sorted({t["commit"] or "?" for t in data["tables"].values()}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
