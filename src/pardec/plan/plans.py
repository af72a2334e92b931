"""A recipe's per-GPU plan: training (per kind) and evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.plan.compose import _trained_hub, check_name, compose, launch_world, paper_recipes
from pardec.plan.drafters import drafter_terms
from pardec.plan.formulas import _max_live, _zero_stage, loss_logits, stack_activations
from pardec.plan.shapes import (
    CAPACITIES_GB,
    COMPONENTS,
    CONTEXT_MARGIN,
    DTYPE_BYTES,
    GB,
    MAX_GPUS,
    OVERHEAD,
    PROMPT_TOKENS,
    Arch,
    Plan,
    arch,
    draft_params,
    drafter_params,
    in_memory,
    lora_params,
)
from pardec.recipes import (
    MODEL_CONFIGS,
    shipped_config,
)

#: fp32 copies of the logits a training step of a kind that trains the target holds beyond them, measured in the
#: whole step (tests/test_plan_measured.py): CLLM's smoothed AR CE over the packed rows and the consistency KL over
#: the Jacobi states (its AR loss alone, measured apart, holds 4: LOSS_PEAK["ce_smoothed"]); SDSAT's ce_sum over
#: the plain and masked rows (alone 3: LOSS_PEAK["ce_sum"])
STEP_COPIES = {"cllm": 2.85, "sdsat": 2.1}
#: fp32 copies of the online teacher's full-vocabulary logits a distilled draft's step holds beyond them: its mass on
#: the kept ids reads a log-sum-exp over the whole vocabulary (training/draft/trainer.py); measured as STEP_COPIES
DRAFT_TEACHER_COPIES = 0.4


# ------------------------------------------------------------------------------------------- plans
def plan(name: str, *, world: int | None = None, gpus: int | None = None, overrides: Sequence[str] = (),
         prompt_tokens: int | None = None, batch: int = 1) -> Plan:
    """The per-GPU memory plan of recipe ``name`` (training: ``world`` ranks, default its launch line's; evaluation:
    the target split over ``gpus`` GPUs under ``model.device_map``, default 1, decoding ``batch`` prompts at once)."""
    name = check_name(name)
    app, cfg = compose(name, overrides)
    if cfg["model"].get("source") == "tiny_random":  # planned only where it is measured (pardec.plan.measured)
        _no_config(name, cfg["model"], None)
    return composed_plan(name, app, cfg, world=world, gpus=gpus, prompt_tokens=prompt_tokens, batch=batch)


def _no_config(name: str, model: dict[str, Any], hub: str | None) -> None:
    where = shipped_config(hub).relative_to(CONF_DIR.parent) if hub else f"source {model.get('source')}"
    raise ConfigError(f"recipe {name!r} runs model {model.get('name')!r} ({where}), which has no shipped "
                      f"config.json; the plan covers the paper recipes: {', '.join(paper_recipes())}")


def composed_plan(name: str, app: str, cfg: dict[str, Any], *, world: int | None = None, gpus: int | None = None,
                  prompt_tokens: int | None = None, batch: int = 1) -> Plan:
    """:func:`plan` of recipe ``name`` already composed (``app``, ``cfg``: :func:`~pardec.plan.compose.compose`); a
    model built in code (``source: tiny_random``) is planned from its own architecture (pardec.plan.measured)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch={batch!r} must be an integer >= 1 (the prompts an evaluation decodes at once)")
    model = cfg["model"]
    hub = model.get("path") if model.get("source") == "hub" else _trained_hub(model.get("path"))
    if model.get("source") == "tiny_random":
        hub = in_memory(model)
    elif hub is None or not shipped_config(hub).is_file():
        _no_config(name, model, hub)
    if app == "train":
        if batch != 1:
            raise ConfigError(f"batch={batch} plans an evaluation decoding several prompts at once; recipe {name!r} "
                              f"trains (its batch is the trainer's per_device_train_batch_size: --set trainer....)")
        return _train_plan(name, cfg, world or launch_world(name))
    return _eval_plan(name, cfg, gpus or 1, prompt_tokens, batch)


def _hub_of(section: dict[str, Any], where: str) -> str:
    """The key of ``section``'s architecture: its hub id (a trained model's: its base's), or a model built in code
    (:func:`~pardec.plan.shapes.in_memory`)."""
    if section.get("source") == "tiny_random":
        return in_memory(section)
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
        # one forward's logits over the packed rows and what the step's loss holds beyond them (STEP_COPIES)
        logits = rows * seq * a.vocab * (act_bytes + 4 * STEP_COPIES[kind])
    elif kind == "draft":
        d = cfg.get("draft") or {}
        n_layers, vocab = len(d.get("layers") or []), int(d.get("vocab_size", a.vocab))
        module, trainable = draft_params(hub, n_layers, vocab, bool(d.get("freeze_embeddings", True)))
        if t.get("teacher", "online") == "online":
            frozen = a.params * run_bytes
        activations = stack_activations(n_layers, b * seq, seq, a, act_bytes, eager, ckpt)
        teacher = b * seq * a.vocab * (run_bytes + 4 * DRAFT_TEACHER_COPIES)
        logits = loss_logits(b * seq, vocab, "kl", act_bytes) + (teacher if frozen else 0)
        notes.append(f"student: {n_layers} layers, {vocab}-token head")
    elif kind == "drafter":  # trainer.model_dtype is the frozen base's here; the drafter is built in fp32
        h = cfg.get("drafter") or {}
        module = trainable = drafter_params(hub, h)
        train_bytes = 2 if (zero and bf16) else 4
        act_bytes = 2 if bf16 else 4
        run_bytes = DTYPE_BYTES[t.get("model_dtype") or cfg["dtype"]]
        frozen = a.params * run_bytes
        d = drafter_terms(h.get("type"))(h, a, b * seq, seq, b, act_bytes, run_bytes, eager, ckpt)
        activations, logits, kv = d.activations, d.logits, d.kv
        notes.append(d.note)
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


def _eval_plan(name: str, cfg: dict[str, Any], gpus: int, prompt_tokens: int | None, batch: int = 1) -> Plan:
    """``batch`` > 1: :func:`pardec.decoding.batch.run_batch`'s memory: the KV caches (target and draft) hold ``batch``
    rows; prompts are prefilled one at a time (one prompt's activations), and a round's logits are ``batch`` rows of
    up to 64 new tokens each."""
    model, draft, method = cfg["model"], cfg.get("draft") or {}, cfg.get("method") or {}
    a = arch(_hub_of(model, "model"))
    split = bool(model.get("device_map"))
    gpus = gpus if split else 1
    t_bytes = DTYPE_BYTES[model.get("dtype") or cfg["dtype"]]
    prompt = prompt_tokens or prompt_estimate(cfg.get("dataset") or {})
    context = prompt + int(cfg.get("max_new_tokens", 256)) + CONTEXT_MARGIN
    weights = a.params * t_bytes
    kv = batch * context * a.kv_bytes_per_token(t_bytes)
    draft_w = draft_kv = 0.0
    notes = [f"context {context} tokens (prompt ~{prompt} + {cfg.get('max_new_tokens')} new + {CONTEXT_MARGIN})"]
    if draft.get("name"):
        d = arch(_hub_of(draft, "draft"))
        d_bytes = DTYPE_BYTES[draft.get("dtype") or cfg["dtype"]]
        draft_w = d.params * d_bytes
        draft_kv = _draft_rows(method, batch) * context * d.kv_bytes_per_token(d_bytes)
        notes.append(f"draft {d.hub_id} ({d.params / 1e9:.2f}B) on the first GPU")
    if batch > 1:
        notes.append(f"batch {batch}: the KV caches hold {batch} rows; prompts prefilled one at a time")
    per_gpu = _eval_components(weights, kv, draft_w, draft_kv, a, prompt, context, t_bytes, gpus,
                               bool((cfg.get("perplexity") or {}).get("enabled", True)), batch)
    p = Plan(recipe=name, kind="eval", world=gpus, zero=None, model=a.hub_id, params=a.params, trainable=0,
             components=per_gpu, notes=notes)
    if split:
        notes.append(f"model.device_map={model['device_map']}: target split over {gpus} GPU(s)")
        for cap in CAPACITIES_GB:
            p.gpus_needed[cap] = next((g for g in range(1, MAX_GPUS + 1) if sum(_eval_components(
                weights, kv, draft_w, draft_kv, a, prompt, context, t_bytes, g,
                bool((cfg.get("perplexity") or {}).get("enabled", True)), batch).values()) <= cap * GB), None)
    return p


def _draft_rows(method: dict[str, Any], batch: int) -> int:
    """Rows of the draft's KV cache: one per prompt (MJSD: one per beam); over a batch, what the batched method takes
    (:meth:`~pardec.decoding.batch.engine.BatchedMethod.draft_rows`: ``spectr`` grows its ``k`` sequences in rows of
    their own)."""
    params = {k: v for k, v in method.items() if k != "name"}
    if batch == 1 or not method.get("name"):
        return batch * int(method.get("num_beams", 1) or 1)
    from pardec.decoding.batch.engine import BATCHED, batched_params  # heavy: torch (a batch only)
    name = method["name"]
    if name not in BATCHED:
        return batch * int(method.get("num_beams", 1) or 1)
    return BATCHED.get(name).draft_rows(batch, batched_params(name, params))


def _eval_components(weights: float, kv: float, draft_w: float, draft_kv: float, a: Arch, prompt: int, context: int,
                     t_bytes: int, gpus: int, perplexity: bool, batch: int = 1) -> dict[str, float]:
    """The busiest GPU (the first: its share of the target plus the draft and the working buffers)."""
    comps = dict.fromkeys(COMPONENTS, 0.0)
    comps["weights"] = weights / gpus + draft_w
    comps["kv"] = kv / gpus + draft_kv
    comps["activations"] = prompt * (4 * a.hidden + 3 * a.intermediate) * t_bytes  # one layer over the prompt
    comps["logits"] = max(context if perplexity else 64, batch * 64) * a.vocab * 4
    comps["overhead"] = OVERHEAD * sum(comps.values())
    return comps
