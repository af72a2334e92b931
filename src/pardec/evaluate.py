"""`python -m evaluate +method=<m> [dataset=<d>] [model=<model>]`: run a method and its baseline on the same
prompts, interleaved per prompt, after a warm-up, with a fixed thread count; write ``results.jsonl`` (one line
per prompt per role, appended as produced) and ``summary.json`` in the Hydra run dir; print a table.

Roles: ``baseline`` (``bench.baseline``, plain ``ar`` at the same dtype), ``method``, and, when
``bench.include_hf=true``, transformers' own decoders as peers: ``hf`` (plain ``generate()``), ``hf_pld`` (its
prompt lookup) and, when a draft is configured, ``hf_assisted`` (assisted generation with the same draft model).
A killed run restarted with ``resume=true`` and the same ``hydra.run.dir`` redoes nothing that was written and
duplicates nothing; it is refused, changing nothing in the run dir, when any setting that changes the records
differs from the first attempt's (``run.json``: model and draft configs, dataset, sampling, max_new_tokens,
stop_at_eos, timeout_s, method and its parameters, roles, ...).

A prompt whose generation hits NaN/inf logits (or gives any non-finite number) gets a record with ``error``: it is
left out of every speed and quality aggregate, counted in the summary, and the run goes on. Nothing non-finite is
ever written: JSON is written with ``allow_nan=False`` after mapping NaN/inf to null.

Energy (``energy.enabled``, on by default): every timed generation is a Zeus window over the hardware energy
counters (NVML on GPUs, RAPL on CPUs, see :mod:`pardec.metrics.energy`); records get ``energy_j`` and the summary
``energy_j_per_token`` per role. Where no counter can be read the summary says "not measured" and why: nothing is
estimated. The warm-up is not measured.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import (
    BenchConfig,
    ConfigError,
    DatasetConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    settings_diff,
    to_dataclass,
)
from pardec.jsonl import append_jsonl, read_jsonl
from pardec.metrics.sandbox import isolation

log = logging.getLogger("pardec.evaluate")

RUN_KEYS = ("n_samples", "max_new_tokens", "threads", "seed", "resume", "timeout_s", "stop_at_eos", "repeats",
            "dtype")
#: peer roles run when ``bench.include_hf=true``: role -> method (``hf_assisted`` only with a draft)
PEERS = {"hf": "hf_generate", "hf_pld": "hf_pld", "hf_assisted": "hf_assisted"}


def parse_also(spec: str) -> tuple[str, dict]:
    """``"sps:adaptive=true:gamma=6"`` -> ("sps", {"adaptive": True, "gamma": 6}); values parsed as YAML scalars."""
    import yaml

    name, *pairs = spec.split(":")
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


def validate(cfg: DictConfig) -> EvalSpec:
    """Check every name and value before anything heavy loads; errors name the bad value and the choices."""
    import pardec.decoding  # noqa: F401
    import pardec.tasks  # noqa: F401
    from pardec.decoding.base import METHODS
    from pardec.tasks.base import TASKS
    from pardec.tracking import LOGGERS

    if cfg.get("method") is None or cfg.method.get("name") is None:
        raise ConfigError(f"no method given: pass +method=<name>; valid methods: {', '.join(METHODS.names())}")
    mcfg = OmegaConf.to_container(cfg.method, resolve=True)
    name = METHODS.canonical(mcfg.pop("name"))
    dataset = to_dataclass(DatasetConfig, cfg.dataset, "dataset")
    TASKS.canonical(dataset.name)
    model = to_dataclass(ModelConfig, cfg.model, "model")
    draft = None
    if cfg.get("draft") is not None and cfg.draft.get("name"):
        draft = to_dataclass(ModelConfig, cfg.draft, "draft")
    run = to_dataclass(RunConfig, {k: cfg.get(k) for k in RUN_KEYS if k in cfg}, "the top-level keys")
    sampling = to_dataclass(SamplingConfig, cfg.get("sampling"), "sampling")
    bench = to_dataclass(BenchConfig, cfg.get("bench"), "bench")
    _check_method(name, mcfg, draft)
    _check_method(bench.baseline, {}, draft, f"bench.baseline={bench.baseline!r}")
    also = []
    for entry in bench.also:
        a_name, a_params = parse_also(entry)
        a_cls = _check_method(a_name, a_params, draft, f"bench.also entry {entry!r}")
        also.append((f"also:{entry}", a_cls.name, a_params))
    logger = OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else {"name": "none"}
    if logger.get("name") not in LOGGERS:
        raise ConfigError(f"logger={logger.get('name')!r} is not valid; choose one of: {', '.join(LOGGERS)}")
    ppl = OmegaConf.to_container(cfg.perplexity, resolve=True) if cfg.get("perplexity") else {"enabled": False}
    energy = OmegaConf.to_container(cfg.energy, resolve=True) if cfg.get("energy") else {"enabled": True}
    if set(energy) - {"enabled"}:
        raise ConfigError(f"energy has no key(s) {sorted(set(energy) - {'enabled'})}; valid: enabled")
    if not isinstance(energy.get("enabled", True), bool):
        raise ConfigError(f"energy.enabled={energy['enabled']!r} must be bool (true or false)")
    _check_models(model, draft)
    for m_name, m_params in [(name, mcfg)] + [(a[1], a[2]) for a in also]:
        METHODS.get(m_name).check_model(model, m_params)  # what a method needs of the model, before it loads
    return EvalSpec(name, mcfg, model, draft, dataset, run, sampling, bench, ppl, logger, also, energy)


def _check_method(name: str, params: dict, draft: ModelConfig | None, where: str = "") -> type:
    """The class of method ``name``, checked without a model: the name, its parameters' names and types (from its
    signature), their ranges (its own ``__init__``) and its need of a draft. ``where`` starts the errors
    (``bench.also entry 'pld:num_pred=0': method.num_pred=0 is out of range ...``)."""
    from pardec.decoding.base import METHODS, check_params
    from pardec.registry import UnknownNameError

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


def _check_models(model: ModelConfig, draft: ModelConfig | None) -> None:
    """Without loading weights: the model (and draft) can be had (local dir exists, hub model cached or reachable)
    and the draft tokenizes like the target (only the tokenizers are loaded)."""
    from pardec.models.loading import check_available, check_same_tokenizer

    check_available(model, "model")
    if draft is not None:
        check_available(draft, "draft")
        check_same_tokenizer(model, draft)


# ------------------------------------------------------------------------------------------------ results
class ResultsLog:
    """Append-only JSONL of per-prompt records; repairs a line truncated by a kill; knows what is done.

    A record is done by (id, role, repeat) whatever it holds: a skipped or errored prompt (``skipped`` /
    ``error``) is not retried on resume (a NaN model would fail again forever); start a new run dir to retry."""

    def __init__(self, path: Path, resume: bool):
        self.path = path
        self.records: list[dict] = []
        self._by_key: dict[tuple, dict] = {}  # (id, role, repeat) -> record
        if path.exists() and path.stat().st_size:
            if not resume:
                raise FileExistsError(
                    f"{path} already holds results; pass resume=true to continue that run, or use a new hydra.run.dir"
                )
            self._load()

    def _load(self) -> None:
        self.records = read_jsonl(self.path, repair=True)
        self._by_key = {(r["id"], r["role"], r.get("repeat", 0)): r for r in self.records}

    def done(self, doc_id: str, role: str, repeat: int) -> dict | None:
        return self._by_key.get((doc_id, role, repeat))

    def append(self, rec: dict) -> None:
        rec = finite(rec)
        append_jsonl(self.path, [rec])
        self.records.append(rec)
        self._by_key[(rec["id"], rec["role"], rec.get("repeat", 0))] = rec


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _scalar_extras(extras: dict) -> dict:
    return {k: v for k, v in extras.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def finite(obj: Any) -> Any:
    """``obj`` with every NaN/inf float (in nested dicts, lists, tuples) replaced by None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def non_finite(obj: Any, where: str = "") -> str | None:
    """Path of the first NaN/inf float in ``obj`` (e.g. ``nll`` or ``extras.fast_forward``), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "value"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        if (hit := non_finite(v, f"{where}.{k}" if where else str(k))) is not None:
            return hit
    return None


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (no NaN/Infinity tokens): non-finite floats become null."""
    path.write_text(json.dumps(finite(obj), indent=2, allow_nan=False))


# ------------------------------------------------------------------------------------------------ harness
def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Evaluate as ``cfg`` says, writing into ``run_dir``; returns the summary."""
    import torch
    from tqdm import tqdm

    from pardec.decoding import METHODS, Stopper, build_decoder
    from pardec.metrics.energy import EnergyMeter
    from pardec.metrics.perplexity import completion_nll
    from pardec.models.cached import CachedModel, NonFiniteLogitsError
    from pardec.models.loading import load_model
    from pardec.tasks.base import build_task, select_docs
    from pardec.tracking import Tracker

    spec = validate(cfg)
    r = spec.run
    identity = run_identity(spec)
    if r.resume:
        check_resume(run_dir, identity)  # before anything is written: a refused run changes nothing
    results = ResultsLog(run_dir / "results.jsonl", r.resume)  # refuses a run dir with records unless resumed
    task = build_task(spec.dataset, timeout_s=r.timeout_s)
    docs = select_docs(task, r.n_samples)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "run.json", identity)
    torch.set_num_threads(r.threads)
    torch.manual_seed(r.seed)
    lm = load_model(spec.model)
    tok = lm.tokenizer
    chat = {"auto": lm.chat, "chat": True, "base": False}[spec.dataset.prompt_style]
    target = CachedModel(lm.model, name=spec.model.name)
    draft = CachedModel(load_model(spec.draft).model, name=f"draft:{spec.draft.name}") if spec.draft else None
    scorer = lm.model
    if spec.perplexity.get("enabled") and spec.perplexity.get("model"):
        from pardec.models.loading import _named

        scorer = load_model(_named(spec.perplexity["model"])).model
    # the GPUs the models run on (their counters only: an idle GPU's energy is no generation's); RAPL: every package
    gpus = {p.device.index or 0 for m in (lm.model, draft.model if draft else None, scorer) if m is not None
            for p in m.parameters() if p.device.type == "cuda"}
    meter = EnergyMeter.create(spec.energy.get("enabled", True), gpus=sorted(gpus))
    if not meter.available:
        log.info("energy not measured: %s", meter.reason)

    roles = [("baseline", METHODS.canonical(spec.bench.baseline), {})]
    if spec.method != roles[0][1]:
        roles.append(("method", spec.method, spec.method_params))
    if spec.bench.include_hf:
        roles += [(role, name, {}) for role, name in PEERS.items()
                  if name not in (spec.method, roles[0][1]) and (draft is not None or not METHODS.get(name).needs_draft)]
    roles += spec.also
    decoders = {role: build_decoder(name, target, tok, draft, **params) for role, name, params in roles}
    method_role = "method" if len(roles) > 1 and roles[1][0] == "method" else "baseline"
    eos = set()
    if r.stop_at_eos:
        gc_eos = lm.model.generation_config.eos_token_id
        eos = {tok.eos_token_id} | set(gc_eos if isinstance(gc_eos, list) else [gc_eos] if gc_eos is not None else [])
        eos.discard(None)
    stopper = Stopper(tok, eos, task.stop_strings(chat))

    if docs and spec.bench.warmup:
        warm_ids = task.prompt_ids(docs[0], tok, chat, [])
        try:
            for _ in range(spec.bench.warmup):  # interleaved, like the timed loop
                for dec in decoders.values():
                    dec.generate(warm_ids, spec.bench.warmup_tokens, stopper, spec.sampling)
        except NonFiniteLogitsError as e:  # the prompts will record it; the warm-up just ends
            log.warning("warm-up stopped: %s", e)

    bar = tqdm(docs, desc=f"{spec.method} on {spec.dataset.name}", unit="prompt", dynamic_ncols=True)
    for i, doc in enumerate(bar):
        for rep in range(r.repeats):
            sampling = spec.sampling if spec.sampling.greedy else SamplingConfig(
                **{**asdict(spec.sampling), "seed": spec.sampling.seed + 100_003 * rep + i})
            for role, name, _ in roles:
                if results.done(doc["id"], role, rep):
                    continue
                try:
                    rec = _run_one(task, doc, decoders[role], tok, chat, stopper, sampling, r.max_new_tokens,
                                   target.max_length, scorer if spec.perplexity.get("enabled") else None,
                                   completion_nll, meter=meter)
                except NonFiniteLogitsError as e:  # this prompt stops here, the run goes on
                    rec = {"error": str(e)}
                if (where := non_finite(rec)) is not None:
                    rec = {**finite(rec), "error": f"non-finite {where} (NaN/inf)"}
                rec.update(id=doc["id"], method=name, role=role, repeat=rep)
                base = results.done(doc["id"], "baseline", rep)
                if role != "baseline" and base is not None and not _failed(rec) and not _failed(base):
                    rec["equal_to_baseline"] = rec["turn_tokens"] == base["turn_tokens"]
                    rec["first_divergence"] = first_divergence(rec["tokens"], base["tokens"])
                results.append(rec)
        bar.set_postfix_str(_running_speed(results.records, method_role))

    summary = finite(summarize(spec, task, results.records, method_role, lm.model.config, energy=meter.status()))
    write_json(run_dir / "summary.json", summary)
    print(format_table(summary))
    group = None
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            group = Path(hc.sweep.dir).name
    except ValueError:  # not running under Hydra (a direct call from Python)
        pass
    with Tracker(spec.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), spec.method, group=group,
                 name=f"{spec.method}-{spec.dataset.name}-{spec.model.name}-{spec.model.dtype}") as tr:
        tr.log_summary(summary)
        tr.log_table("per_prompt", [{k: v for k, v in rec.items() if k not in ("tokens", "turn_tokens", "accepted")}
                                    for rec in results.records])
    return summary


def run_identity(spec: EvalSpec) -> dict[str, Any]:
    """Everything that changes the records of a run (``run.json``); a resumed run must match it in every key."""
    r = spec.run
    return {"method": spec.method, "method_params": spec.method_params, "model": spec.model.identity(),
            "draft": spec.draft.identity() if spec.draft else None, "dataset": asdict(spec.dataset),
            "max_new_tokens": r.max_new_tokens, "stop_at_eos": r.stop_at_eos, "timeout_s": r.timeout_s,
            "repeats": r.repeats, "threads": r.threads, "seed": r.seed, "sampling": asdict(spec.sampling),
            "baseline": spec.bench.baseline, "include_hf": spec.bench.include_hf, "also": spec.bench.also,
            "perplexity": spec.perplexity}


def check_resume(run_dir: Path, identity: dict) -> None:
    """Refuse, writing nothing, to resume ``run_dir`` unless its records were made as ``identity`` says (every
    key equal to the one in its ``run.json``); a run dir without records is not checked."""
    results = run_dir / "results.jsonl"
    if not (results.is_file() and results.stat().st_size):
        return  # no records yet: nothing to mix with
    path = run_dir / "run.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    diff = settings_diff(old, json.loads(json.dumps(identity)))  # as it would be written (tuples -> lists)
    if diff:
        raise ConfigError(f"cannot resume {run_dir}: its records were made with other settings ({'; '.join(diff)}); "
                          f"rerun with those settings, or start a new run with another hydra.run.dir")


def _run_one(task, doc, dec, tok, chat, stopper, sampling, max_new, max_len, scorer, completion_nll,
             meter=None) -> dict:
    """All turns of one document with one decoder -> a results.jsonl record (without id/role). ``meter`` (an
    :class:`~pardec.metrics.energy.EnergyMeter`, None = not measured) measures each ``generate`` call: ``energy_j``
    is their sum, None if any turn was not measured; ``energy_by_device`` its split ({} when not measured)."""
    from pardec.metrics.energy import EnergyMeter

    meter = meter or EnergyMeter()  # a meter without a monitor: every reading is None
    history: list[str] = []
    energy: list[float | None] = []
    by_device: dict[str, float] = {}
    turns, accepted, extras = [], [], []
    tf = df = drafted = draft_acc = 0
    wall = prefill = nll = draft_s = 0.0
    n_nll = 0
    for _ in range(task.n_turns):
        ids = task.prompt_ids(doc, tok, chat, history)
        if len(ids) + max_new > max_len:
            return {"skipped": f"prompt of {len(ids)} tokens + max_new_tokens {max_new} exceeds the model's "
                               f"context of {max_len} tokens"}
        with meter.window(getattr(dec, "name", "generate")) as reading:
            res = dec.generate(ids, max_new, stopper, sampling)
        energy.append(reading.joules)
        for k, v in reading.by_device.items():
            by_device[k] = by_device.get(k, 0.0) + v
        text = stopper.final_text(res.tokens)
        history.append(text)
        turns.append(res.tokens)
        accepted += res.accepted
        extras.append(_scalar_extras(res.extras))
        tf, df = tf + res.target_forwards, df + res.draft_forwards
        wall, prefill, draft_s = wall + res.total_s, prefill + res.prefill_s, draft_s + res.draft_s
        drafted, draft_acc = drafted + res.drafted, draft_acc + res.draft_accepted
        if scorer is not None:
            s, n = completion_nll(scorer, ids, res.tokens)
            nll, n_nll = nll + s, n_nll + n
    flat = [t for turn in turns for t in turn]
    measured = bool(energy) and all(e is not None for e in energy)
    return {
        "n_tokens": len(flat), "tokens": flat, "turn_tokens": turns,
        "text": history[0] if len(history) == 1 else history,
        "target_forwards": tf, "draft_forwards": df, "accepted": accepted,
        "wall_s": wall, "prefill_s": prefill,
        "draft_s": draft_s, "drafted": drafted, "draft_accepted": draft_acc,
        "equal_to_baseline": None, "first_divergence": None,
        "score": task.score(doc, history),
        "nll": nll if scorer is not None else None, "nll_tokens": n_nll,
        "energy_j": sum(energy) if measured else None, "energy_by_device": by_device if measured else {},
        "extras": {k: statistics.fmean(e[k] for e in extras if k in e) for k in extras[0]} if extras else {},
    }


def _failed(rec: dict) -> bool:
    """A record that holds no generation to measure: skipped (too long) or errored (non-finite)."""
    return "skipped" in rec or "error" in rec


def _running_speed(records: list[dict], method_role: str) -> str:
    from pardec.metrics.speed import tokens_per_s

    m = [x for x in records if x["role"] == method_role and not _failed(x)]
    b = [x for x in records if x["role"] == "baseline" and not _failed(x)]
    mt, bt = tokens_per_s(m) if m else None, tokens_per_s(b) if b else None
    return f"{mt:.1f} tok/s, x{mt / bt:.2f}" if mt and bt else ""


def summarize(spec: EvalSpec, task, records: list[dict], method_role: str, model_config,
              energy: dict | None = None) -> dict[str, Any]:
    """The run's summary. ``energy``: the meter's ``status()`` (``measured``, ``reason``, ``devices``); without it,
    what the records say (measured where some record has ``energy_j``)."""
    from pardec.decoding import METHODS
    from pardec.decoding.base import lossless_under_greedy
    from pardec.metrics.energy import joules_per_token
    from pardec.metrics.perplexity import perplexity
    from pardec.metrics.speed import speed_summary, tokens_per_s

    ok = [x for x in records if not _failed(x)]
    also = {role: name for role, name, _ in spec.also}
    also_params = {role: params for role, _, params in spec.also}
    rows = {role: [x for x in ok if x["role"] == role] for role in ("baseline", "method", *PEERS, *also)}
    method_rows = rows[method_role]
    skipped = sorted({x["id"] for x in records if "skipped" in x})
    errors = [{k: x[k] for k in ("id", "role", "repeat", "error")} for x in records if "error" in x]
    cls = METHODS.get(spec.method)
    if energy is None:
        measured = any(x.get("energy_j") is not None for x in ok)
        energy = {"measured": measured, "reason": None if measured else "no energy meter in this run", "devices": ""}

    def exact(role_rows: list[dict], method: str) -> float | None:
        """Share of prompts equal to the baseline, for methods lossless under greedy decoding (else None)."""
        if not (lossless_under_greedy(METHODS.get(method)) and spec.sampling.greedy):
            return None
        eq = [x["equal_to_baseline"] for x in role_rows if x.get("equal_to_baseline") is not None]
        return sum(eq) / len(eq) if eq else None

    def quality(rs: list[dict]) -> dict:
        first = [x for x in rs if x.get("repeat", 0) == 0]
        return task.aggregate([x["score"] for x in first]) if first else {}

    def ppl(rs: list[dict]) -> float | None:
        n = sum(x.get("nll_tokens") or 0 for x in rs)
        s = sum(x.get("nll") or 0.0 for x in rs)
        return perplexity(s, n) if n and s / n < 700 else None  # exp() of more overflows: no meaningful value

    def drafting(rs: list[dict]) -> dict:
        """Draft use of some records: acceptance of drafted tokens, mean tokens committed per target forward
        (``accepted``), the draft's share of wall time; None where the records did not draft."""
        drafted, wall = sum(x.get("drafted") or 0 for x in rs), sum(x["wall_s"] for x in rs)
        forwards = sum(x.get("draft_forwards") or 0 for x in rs)
        acc = [a for x in rs for a in x.get("accepted") or []]
        return {"draft_forwards": forwards,
                "draft_acceptance": sum(x.get("draft_accepted") or 0 for x in rs) / drafted if drafted else None,
                "mean_accepted_length": statistics.fmean(acc) if acc else None,
                "draft_time_share": sum(x.get("draft_s") or 0.0 for x in rs) / wall if wall > 0 and forwards else None}

    mq, bq = quality(method_rows), quality(rows["baseline"])
    role_method = {"baseline": spec.bench.baseline, "method": spec.method, **PEERS, **also}
    if method_role == "baseline":
        method_exact = 1.0 if method_rows and lossless_under_greedy(cls) and spec.sampling.greedy else None
    else:
        method_exact = exact(method_rows, spec.method)
    peers = {}
    for role in (*PEERS, *also):
        if rows[role]:
            sp = speed_summary(rows[role], rows["baseline"])
            peers[role] = {"method": role_method[role], "exactness": METHODS.get(role_method[role]).exactness,
                           "params": also_params.get(role, {}),
                           "tokens_per_s": sp["tokens_per_s"], "speedup": sp["speedup"],
                           "speedup_median": sp.get("speedup_median"),
                           "tokens_per_forward": sp["tokens_per_forward"],
                           "exact_match_rate": exact(rows[role], role_method[role]),
                           "energy_j_per_token": joules_per_token(rows[role]), "perplexity": ppl(rows[role]),
                           "metric": quality(rows[role]).get(task.metric), **drafting(rows[role])}
    summary: dict[str, Any] = {
        "method": spec.method,
        "method_params": spec.method_params,
        "baseline": spec.bench.baseline,
        "draft": spec.draft.name if spec.draft else None,
        "draft_path": spec.draft.path if spec.draft else None,  # a config name (``local``) names no one draft
        "dataset": spec.dataset.name,
        "model": spec.model.name,
        "dtype": spec.model.dtype,
        "n_samples": len({x["id"] for x in method_rows}),
        "skipped": skipped,
        "n_errors": len(errors),
        "errors": errors,
        "repeats": spec.run.repeats,
        "max_new_tokens": spec.run.max_new_tokens,
        "sampling": asdict(spec.sampling),
        "threads": spec.run.threads,
        "sandbox": isolation() if task.sandboxed else None,  # which isolation ran model output, see metrics/sandbox.py
        "exactness": cls.exactness,
        **speed_summary(method_rows, rows["baseline"] or method_rows),
        "hf_tokens_per_s": tokens_per_s(rows["hf"]) if rows["hf"] else None,
        "exact_match_rate": method_exact,
        "first_divergences": [x["first_divergence"] for x in method_rows if x.get("first_divergence") is not None],
        **drafting(method_rows),
        "peers": peers,
        "metric_name": task.metric,
        "metric": mq.get(task.metric),
        "baseline_metric": bq.get(task.metric),
        "metrics": mq,
        "perplexity": ppl(method_rows),
        "baseline_perplexity": ppl(rows["baseline"]),
        "energy": dict(energy),
        "energy_j_per_token": joules_per_token(method_rows),
        "baseline_energy_j_per_token": joules_per_token(rows["baseline"]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "extras": {k: statistics.fmean(x["extras"][k] for x in method_rows if k in x["extras"])
                   for k in sorted({k for x in method_rows for k in x["extras"]})},
    }
    if rows["hf"]:
        summary["hf_exact_match_rate"] = peers["hf"]["exact_match_rate"]
    try:
        import torch

        if torch.cuda.is_available():
            summary["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    except RuntimeError:
        pass
    if task.metric == "pass" and spec.run.repeats > 1 and not spec.sampling.greedy:
        summary["pass_at_k"] = _pass_at_k(method_rows, spec.run.repeats)
    return summary


def _pass_at_k(rows: list[dict], n: int) -> dict[str, float]:
    from pardec.metrics.passk import pass_at_k

    per_doc: dict[str, list[float]] = {}
    for x in rows:
        per_doc.setdefault(x["id"], []).append(float(x["score"].get("pass") or 0.0))
    out = {}
    for k in (1, 2, 5, 10, 100):
        if k <= n:
            vals = [pass_at_k(len(v), int(sum(v)), k) for v in per_doc.values() if len(v) >= k]
            out[f"pass@{k}"] = statistics.fmean(vals) if vals else None
    return out


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def comparison_rows(s: dict) -> list[dict[str, Any]]:
    """Baseline, peers and method side by side: role, method, tokens/s, speedup vs the baseline, tokens per
    target forward, exact match vs the baseline, draft acceptance, energy per generated token (None: not
    measured)."""
    rows = [{"role": "baseline", "method": s["baseline"], "tokens_per_s": s["baseline_tokens_per_s"],
             "speedup": 1.0 if s["baseline_tokens_per_s"] else None,
             "tokens_per_forward": s.get("baseline_tokens_per_forward"), "exact_match_rate": None,
             "draft_acceptance": None, "draft_time_share": None,
             "energy_j_per_token": s.get("baseline_energy_j_per_token")}]
    rows += [{"role": role, **p} for role, p in (s.get("peers") or {}).items()]
    if s["method"] != s["baseline"]:
        rows.append({"role": "method", "method": s["method"], **{k: s.get(k) for k in (
            "tokens_per_s", "speedup", "tokens_per_forward", "exact_match_rate", "draft_acceptance",
            "draft_time_share", "energy_j_per_token")}})
    return rows


def format_comparison(s: dict) -> str:
    """:func:`comparison_rows` as an aligned text table."""
    head = ("role", "method", "tokens/s", f"speedup vs {s['baseline']}", "tokens/forward", "exact match",
            "draft acceptance", "draft time share", "energy J/token")
    body = [(r["role"], r["method"], _fmt(r["tokens_per_s"], ".2f"), _fmt(r["speedup"], ".2f"),
             _fmt(r["tokens_per_forward"], ".2f"), _fmt(r["exact_match_rate"], ".2f"),
             _fmt(r.get("draft_acceptance"), ".2f"), _fmt(r.get("draft_time_share"), ".2f"),
             _fmt(r.get("energy_j_per_token"), ".4g"))
            for r in comparison_rows(s)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(f"{x:<{w}}" for x, w in zip(line, widths)).rstrip() for line in (head, *body))


def _energy_rows(s: dict) -> list[tuple[str, Any]]:
    """The energy row(s) of :func:`format_table`: J/token of method and baseline, or "not measured: <reason>"."""
    e = s.get("energy") or {}
    if not e.get("measured"):
        return [("energy J/token (method / baseline)", f"not measured: {e.get('reason') or 'no energy meter'}")]
    rows = [("energy J/token (method / baseline)",
             f"{_fmt(s.get('energy_j_per_token'), '.4g')} / {_fmt(s.get('baseline_energy_j_per_token'), '.4g')}")]
    return rows + [("energy counters", "; ".join(x for x in (e.get("devices"), e.get("reason")) if x) or None)]


def format_table(s: dict) -> str:
    rows = [
        ("method", s["method"]), ("baseline", s["baseline"]), ("dataset", s["dataset"]), ("model", s["model"]),
        ("draft", s.get("draft")), ("dtype", s["dtype"]), ("n_samples", s["n_samples"]), ("repeats", s["repeats"]),
        ("exactness", s.get("exactness")),
        ("tokens/s", f"{_fmt(s['tokens_per_s'], '.2f')} ± {_fmt(s['tokens_per_s_std'], '.2f')}"),
        ("baseline tokens/s", f"{_fmt(s['baseline_tokens_per_s'], '.2f')} ± {_fmt(s['baseline_tokens_per_s_std'], '.2f')}"),
        ("hf generate tokens/s", _fmt(s["hf_tokens_per_s"], ".2f")),
        ("speedup (total time)", f"{_fmt(s['speedup'], '.3f')} ± {_fmt(s['speedup_std'], '.3f')}"),
        ("speedup (median prompt)", _fmt(s["speedup_median"], ".3f")),
        ("tokens / target forward", _fmt(s["tokens_per_forward"], ".3f")),
        ("exact match vs baseline", _fmt(s["exact_match_rate"], ".3f")),
        (f"{s['metric_name']} (method / baseline)", f"{_fmt(s['metric'])} / {_fmt(s['baseline_metric'])}"),
        ("perplexity (method / baseline)", f"{_fmt(s['perplexity'])} / {_fmt(s['baseline_perplexity'])}"),
        *_energy_rows(s),
        ("peak RSS MB", _fmt(s["peak_rss_mb"], ".0f")),
    ]
    if s.get("draft") or s.get("draft_acceptance") is not None:
        rows += [("draft forwards", _fmt(s.get("draft_forwards"))),
                 ("draft acceptance", _fmt(s.get("draft_acceptance"), ".3f")),
                 ("mean accepted length", _fmt(s.get("mean_accepted_length"), ".3f")),
                 ("draft share of wall time", _fmt(s.get("draft_time_share"), ".3f"))]
    rows += [(k, _fmt(v)) for k, v in s["extras"].items()]
    if s.get("pass_at_k"):
        rows += [(k, _fmt(v)) for k, v in s["pass_at_k"].items()]
    if s["skipped"]:
        rows.append(("skipped prompts", len(s["skipped"])))
    if s.get("n_errors"):
        first = s["errors"][0]
        rows.append(("errors", f"{s['n_errors']} (first: {first['role']} on {first['id']}: {first['error']})"))
    w = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{w}}  {'–' if v is None else v}" for k, v in rows)
    return table + "\n\n" + format_comparison(s)


def _hydra_subdir(output_dir: str, subdir: str) -> str | None:
    """``hydra.output_subdir`` of ``conf/evaluate.yaml``: None (Hydra writes no config files) when ``output_dir``
    already holds a run (``run.json``), so a resumed or a refused attempt leaves the first one's as they were."""
    return None if (Path(output_dir) / "run.json").is_file() else subdir


if not OmegaConf.has_resolver("pardec_hydra_subdir"):
    OmegaConf.register_new_resolver("pardec_hydra_subdir", _hydra_subdir)


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from pardec.config import check_overrides, exit_with_error

    try:
        check_overrides(sys.argv[1:], "evaluate")
    except ConfigError as e:
        exit_with_error(e)

    @hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        try:
            summary = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ConfigError, KeyError, FileNotFoundError, FileExistsError, ValueError) as e:
            exit_with_error(e)
        return summary.get("speedup")

    _app()
