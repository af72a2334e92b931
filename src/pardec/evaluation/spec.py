"""What an evaluation run is: :class:`EvalSpec`, checked by :func:`validate` before anything heavy loads, and its
identity (:func:`run_identity`, ``run.json``), which a resumed run must match (:func:`check_resume`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pardec import recipes, zoo
from pardec.config import (
    BenchConfig,
    ConfigError,
    DatasetConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    check_choice,
    settings_diff,
    to_dataclass,
)
from pardec.decoding.base import METHODS, check_attention, check_params, method_params
from pardec.evaluation import batched
from pardec.evaluation.results import results_files
from pardec.jsonl import read_json
from pardec.models.forward import FORWARDS
from pardec.models.placement import rank_devices
from pardec.models.preflight import check_available, check_same_tokenizer
from pardec.registry import UnknownNameError
from pardec.tasks.base import TASKS, build_task
from pardec.tracking import LOGGERS

RUN_KEYS = ("n_samples", "max_new_tokens", "threads", "seed", "resume", "timeout_s", "stop_at_eos", "repeats",
            "dtype", "tf32", "forward_padding", "kv_cache", "forward_impl", "draft_forward_impl", "batch_size")
#: peer roles run when ``bench.include_hf=true``: role -> method (``hf_assisted`` only with a draft)
PEERS = {"hf": "hf_generate", "hf_pld": "hf_pld", "hf_assisted": "hf_assisted"}


#: ``draft.source`` of a drafter that its method loads itself -> that method (``draft=eagle3``: an EAGLE-3 drafter
#: for method eagle3; ``draft=dflash``: a DFlash drafter for method dflash)
DRAFTER_SOURCES = {"eagle3": "eagle3", "dflash": "dflash"}

def split_method(spec: str) -> list[str]:
    """``"medusa:path=zoo:medusa:tree=T63"`` -> ["medusa", "path=zoo:medusa", "tree=T63"]: a method and its
    ``key=value`` parameters: a part without ``=`` after a parameter belongs to its value (``zoo:<name>``); right
    after the method's name it stays a part of its own (and is refused as not key=value)."""
    name, *parts = spec.split(":")
    out = [name]
    for part in parts:
        if "=" not in part and len(out) > 1:
            out[-1] += ":" + part
        else:
            out.append(part)
    return out


def parse_also(spec: str) -> tuple[str, dict]:
    """``"sps:adaptive=true:gamma=6"`` -> ("sps", {"adaptive": True, "gamma": 6}); values parsed as YAML scalars."""
    name, *pairs = split_method(spec)
    params = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"bench.also entry {spec!r}: {pair!r} is not key=value; write e.g. 'sps:adaptive=true'")
        params[key] = yaml.safe_load(value)
    return name, params


@dataclass
class EvalSpec:
    method: str
    method_params: dict
    model: ModelConfig
    draft: ModelConfig | None
    dataset: DatasetConfig
    run: RunConfig
    sampling: SamplingConfig
    bench: BenchConfig
    perplexity: dict
    logger: dict
    also: list[tuple[str, str, dict]] = field(default_factory=list)  # (role, method, params) of bench.also
    energy: dict = field(default_factory=lambda: {"enabled": True})  # not in run_identity: it changes no token
    # where this rank's target (its first GPU when split) and draft go (pardec.models.placement.rank_devices); not in
    # run_identity: ranks differ in it, and it changes no token
    devices: tuple = ("cpu", None)


def validate(cfg: DictConfig) -> EvalSpec:
    """Check every name and value before anything heavy loads; errors name the bad value and the choices. A task
    that runs model output (code, SQL) also gets its sandbox checked here (:func:`check_scorer`)."""
    if cfg.get("method") is None or cfg.method.get("name") is None:
        raise ConfigError(f"no method given: pass +method=<name>; valid methods: {', '.join(METHODS.names())}")
    mcfg = OmegaConf.to_container(cfg.method, resolve=True)
    name = METHODS.canonical(mcfg.pop("name"))
    dataset = to_dataclass(DatasetConfig, cfg.dataset, "dataset")
    TASKS.canonical(dataset.name)
    model = to_dataclass(ModelConfig, cfg.model, "model")
    draft = None
    source = None if cfg.get("draft") is None else cfg.draft.get("source")
    model = resolve_model_path(model, "model", None)
    for key, value in mcfg.items():  # a drafter kept in the zoo: method.path=zoo:eagle3, zoo:medusa, ...
        mcfg[key] = zoo.resolve(value, f"method.{key}", model.name)
    if source in DRAFTER_SOURCES:  # draft=eagle3 / draft=dflash: a drafter its method loads, no model
        owner = DRAFTER_SOURCES[source]
        if name != owner:
            raise ConfigError(f"draft={cfg.draft.get('name')} names a {source} drafter, which method {owner} loads; method "
                              f"{name!r} needs a draft model (draft=local draft.path=<dir>, draft=hub, ...) or none")
        if mcfg.get("path") not in (None, cfg.draft.get("path")):
            raise ConfigError(f"method.path={mcfg['path']!r} and draft.path={cfg.draft.get('path')!r} both name the "
                              f"{source} drafter: give one")
        mcfg["path"] = zoo.resolve(cfg.draft.get("path"), "draft.path", model.name)
    elif cfg.get("draft") is not None and cfg.draft.get("name"):
        draft = resolve_model_path(to_dataclass(ModelConfig, cfg.draft, "draft"), "draft", model.name)
    run = to_dataclass(RunConfig, {k: cfg.get(k) for k in RUN_KEYS if k in cfg}, "the top-level keys")
    sampling = to_dataclass(SamplingConfig, cfg.get("sampling"), "sampling")
    bench = to_dataclass(BenchConfig, cfg.get("bench"), "bench")
    devices = check_placement(model, draft, run)  # before anything reads a drafter or probes the hub
    try:
        check_method(name, mcfg, draft)
    except ConfigError as e:
        raise ConfigError(f"{e}{_recipe_note(mcfg, name)}") from None
    check_method(bench.baseline, {}, draft, f"bench.baseline={bench.baseline!r}")
    also = []
    for entry in bench.also:
        a_name, a_params = parse_also(entry)
        a_params = {k: zoo.resolve(v, f"bench.also entry {entry!r}: method.{k}", model.name) for k, v in a_params.items()}
        a_cls = check_method(a_name, a_params, draft, f"bench.also entry {entry!r}")
        also.append((f"also:{entry}", a_cls.name, a_params))
    logger = OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else {"name": "none"}
    check_choice("logger", logger.get("name"), LOGGERS)
    ppl = OmegaConf.to_container(cfg.perplexity, resolve=True) if cfg.get("perplexity") else {"enabled": False}
    energy = OmegaConf.to_container(cfg.energy, resolve=True) if cfg.get("energy") else {"enabled": True}
    if set(energy) - {"enabled"}:
        raise ConfigError(f"energy has no key(s) {sorted(set(energy) - {'enabled'})}; valid: enabled")
    if not isinstance(energy.get("enabled", True), bool):
        raise ConfigError(f"energy.enabled={energy['enabled']!r} must be bool (true or false)")
    spec = EvalSpec(name, mcfg, model, draft, dataset, run, sampling, bench, ppl, logger, also, energy, devices)
    batched.check(spec)  # batch_size > 1: every role batched (before any hub probe)
    check_models(model, draft)
    for m_name, m_params in [(name, mcfg)] + [(a[1], a[2]) for a in also]:
        METHODS.get(m_name).check_model(model, m_params)  # what a method needs of the model, before it loads
        check_attention(m_name, model, draft)
    check_scorer(dataset, run)
    return spec


def resolve_model_path(cfg: ModelConfig, key: str, target: str | None) -> ModelConfig:
    """``<key>.path=zoo:<name>``: a model or draft kept in the zoo, verified, as the local directory it is read from
    (``target``: the run's model, which a draft must have been made for; None for the model itself)."""
    if not zoo.is_ref(cfg.path):
        return cfg
    if cfg.source != "local":
        raise ConfigError(f"{key}.path={cfg.path!r} names a zoo artifact, which is a local directory: use "
                          f"{key}=local {key}.path={cfg.path} ({key}.source is {cfg.source!r})")

    return replace(cfg, path=zoo.resolve(cfg.path, f"{key}.path", target))


def check_placement(model: ModelConfig, draft: ModelConfig | None, run: RunConfig) -> tuple:
    """Before any weights load: where this rank's models go (:func:`~pardec.models.placement.rank_devices`: under
    several processes a split target's rank owns a disjoint group of GPUs and its draft lives in it), and that each
    model's forward can run there: a target split with ``model.device_map`` runs ``hf`` only (``auto`` picks it),
    ``cudagraph`` needs CUDA."""
    devices = rank_devices(model, draft)
    for key, cfg, impl, dev in (("forward_impl", model, run.forward_impl, devices[0]),
                                ("draft_forward_impl", draft, run.draft_forward_impl or run.forward_impl, devices[1])):
        if cfg is None or impl == "auto":
            continue
        fwd = FORWARDS.get(impl)
        if cfg.device_map and fwd.own:  # (its own forwards run on one device)
            other = "; the draft's is draft_forward_impl" if key == "forward_impl" else ""
            raise ConfigError(f"{key}={impl} cannot run {cfg.name!r}: it is split over several GPUs "
                              f"({'draft' if key != 'forward_impl' else 'model'}.device_map={cfg.device_map}), which "
                              f"only the hf forward follows; use {key}=auto or hf{other}")
        if fwd.device_type is not None and dev.type != fwd.device_type:
            raise ConfigError(f"{key}={impl} replays CUDA graphs but {cfg.name!r} runs on {dev}; use {key}=auto "
                              f"or compiled")
    return devices


def _recipe_note(params: dict, name: str) -> str:
    """Where the run's recipe (``+recipe=...``) set method parameters that method ``name`` does not take: a note for
    its error (:func:`pardec.recipes.stray_method_keys`); empty otherwise."""
    try:
        recipe = HydraConfig.get().runtime.choices.get("recipe")
    except ValueError:  # (no Hydra run: a config composed by a tool)
        return ""
    if not recipe or recipe not in recipes.recipes():
        return ""
    taken = method_params(METHODS.get(name))
    return recipes.stray_method_keys(recipe, [k for k in params if k not in taken])


def check_method(name: str, params: dict, draft: ModelConfig | None, where: str = "") -> type:
    """The class of method ``name``, checked without a model: the name, its parameters' names and types (from its
    signature), their ranges (its own ``__init__``) and its need of a draft. ``where`` starts the errors
    (``bench.also entry 'pld:num_pred=0': method.num_pred=0 is out of range ...``)."""
    try:
        cls = METHODS.get(name)
        check_params(cls, params)
        cls(None, None, None, **params)  # range checks of the method's own parameters (no model needed)
        if cls.needs_draft and draft is None:
            raise ConfigError(f"method {cls.name!r} needs a draft model: pass draft=<name>")
    except (ConfigError, UnknownNameError) as e:
        if not where:
            raise
        raise ConfigError(f"{where}: {e}") from None
    return cls


def check_models(model: ModelConfig, draft: ModelConfig | None) -> None:
    """Without loading weights: the model (and draft) can be had (local dir exists, hub model cached or reachable)
    and the draft tokenizes like the target (only the tokenizers are loaded)."""
    check_available(model, "model")
    if draft is not None:
        check_available(draft, "draft")
        check_same_tokenizer(model, draft)


def check_scorer(dataset: DatasetConfig, run: RunConfig) -> None:
    """For a task whose scorer runs model output (``sandboxed``: HumanEval's code, Spider's SQL): its sandbox
    canary (:meth:`~pardec.tasks.base.Task.check_sandbox`), before any model loads. A sandbox that cannot run a
    known-good program raises :class:`~pardec.metrics.sandbox.SandboxError` (one line naming the cause) instead of
    letting every completion score 0. Other tasks: nothing."""
    if TASKS.get(dataset.name).sandboxed:
        build_task(dataset, timeout_s=run.timeout_s).check_sandbox()


def run_identity(spec: EvalSpec, world_size: int = 1) -> dict[str, Any]:
    """Everything that changes the records of a run (``run.json``); a resumed run must match it in every key.
    ``world_size``: the number of processes (ranks) the documents are shared out over (index % world_size), which
    fixes which part file holds which document."""
    r = spec.run
    return {"world_size": world_size, "method": spec.method, "method_params": spec.method_params, "model": spec.model.identity(),
            "draft": spec.draft.identity() if spec.draft else None, "dataset": asdict(spec.dataset),
            "max_new_tokens": r.max_new_tokens, "stop_at_eos": r.stop_at_eos, "timeout_s": r.timeout_s,
            "repeats": r.repeats, "threads": r.threads, "seed": r.seed, "sampling": asdict(spec.sampling),
            "baseline": spec.bench.baseline, "include_hf": spec.bench.include_hf, "also": spec.bench.also,
            "perplexity": spec.perplexity, **({"batch_size": r.batch_size} if r.batch_size != 1 else {})}


def check_has_run(run_dir: Path) -> None:
    """``resume=true`` needs a run to resume: ``run_dir`` holds a ``run.json`` or records (merged or any rank's
    part), else one line naming the dir (a new dir would silently start afresh). A dir named by a launch id
    (``torchrun-``/``deepspeed-``) is one a relaunch made anew: the error says to pass the old one."""
    if (run_dir / "run.json").is_file() or results_files(run_dir):
        return
    hint = "pass hydra.run.dir=<the killed run's dir>, or drop resume=true to start a new run"
    if run_dir.name.startswith(("torchrun-", "deepspeed-")):
        hint = "a relaunch gets a new launch id: pass hydra.run.dir=<the old run dir>, or drop resume=true"
    raise ConfigError(f"resume=true but {run_dir} holds no run to resume (no run.json, no results): {hint}")


def check_resume(run_dir: Path, identity: dict) -> None:
    """Refuse, writing nothing, to resume ``run_dir`` unless its records were made as ``identity`` says (every
    key equal to the one in its ``run.json``; a ``run.json`` without ``world_size`` was written by one process); a
    run dir without records (merged or any rank's part) is not checked, and one without a run is refused
    (:func:`check_has_run`). Another number of processes is refused too: each rank's part file holds the documents
    of its index % world_size, so they would be redone or lost."""
    check_has_run(run_dir)
    if not results_files(run_dir):
        return  # no records yet: nothing to mix with
    path = run_dir / "run.json"
    old = read_json(path, ConfigError, "the run's identity") if path.is_file() else {}
    if old:
        old.setdefault("world_size", 1)
    diff = settings_diff(old, json.loads(json.dumps(identity)))  # as it would be written (tuples -> lists)
    if diff:
        how = "rerun with those settings"
        if old.get("world_size") != identity.get("world_size"):
            n = old.get("world_size")
            how = (f"its documents are shared out over {n} process(es) (index % {n}): resume it with {n} "
                   f"({'no launcher' if n == 1 else f'torchrun --nproc_per_node {n}'}) and those settings")
        raise ConfigError(f"cannot resume {run_dir}: its records were made with other settings ({'; '.join(diff)}); "
                          f"{how}, or start a new run with another hydra.run.dir")
