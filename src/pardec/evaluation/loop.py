"""The run loop of :func:`run`: validate, load, warm up, then every prompt with every role in turn (interleaved per
prompt, so drift in the machine's speed hits every role alike), one :func:`run_document` per prompt per role per
repeat, appended to ``results.jsonl`` as produced; then ``summary.json``, the printed table and the logger.

Under a launcher of several processes (:mod:`~pardec.evaluation.ranks`) each rank runs this loop over its share of
the prompts on its own device, appending to its own part file, and its records say where they were made (``rank``,
``host``, ``device``); rank 0 waits for the others, merges the parts into ``results.jsonl`` (document order, then
repeat, then role order as run) and alone writes the summary (with ``ranks``), prints the table and logs.

Where a role's tokens differ from the baseline's under greedy decoding (``first_divergence``),
:func:`divergence_logits` adds the target's top-2 logits there, outside any timed region: ``divergence_margin``
tells a near-tie flip from a bug (:data:`~pardec.evaluation.summary.NEAR_TIE_ULPS`). Sampled runs differ by design:
no margin is read there."""

from __future__ import annotations

import inspect
import logging
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pardec.config import SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.evaluation import ranks as rk
from pardec.evaluation.batched import run_roles
from pardec.evaluation.results import (
    ResultsLog,
    check_new,
    finite,
    first_divergence,
    is_failed,
    merge_parts,
    non_finite,
    part_path,
    write_json,
)
from pardec.evaluation.spec import PEERS, check_has_run, check_resume, run_identity, validate
from pardec.evaluation.summary import running_speed, scorer_dtype, summarize
from pardec.evaluation.tables import format_table
from pardec.metrics.busy import Contention, CpuMeter, free_cores
from pardec.metrics.energy import EnergyMeter
from pardec.metrics.perplexity import completion_nll
from pardec.models.cached import CachedModel, NonFiniteLogitsError
from pardec.models.cost import CostTable
from pardec.models.loading import load_model, named_config
from pardec.models.placement import set_tf32
from pardec.models.quant.packed import is_packed
from pardec.runlock import die_with_parent, run_dir_lock
from pardec.tasks.base import build_task, select_docs
from pardec.tracking import Tracker

log = logging.getLogger("pardec.evaluate")  # the name its messages have always carried


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Evaluate as ``cfg`` says, writing into ``run_dir``; returns the summary (on rank 0; other ranks: {})."""
    if cfg.get("resume") is True:
        check_has_run(run_dir)  # before validation reads any model or tokenizer
    spec = validate(cfg)
    ranks = rk.Ranks.from_env()
    identity = run_identity(spec, ranks.world)
    if ranks.multi:
        die_with_parent()  # a rank whose launcher is killed writes nothing more
    with run_dir_lock(run_dir, ranks.rank):  # one writer per run dir (and rank), before anything is written
        return _locked(cfg, run_dir, spec, ranks, identity)


def _locked(cfg: DictConfig, run_dir: Path, spec, ranks: rk.Ranks, identity: dict) -> dict[str, Any]:
    r = spec.run
    # before anything is written, on every rank: a refused run changes nothing
    if r.resume:
        check_resume(run_dir, identity)
    else:
        check_new(run_dir)  # any rank's records: refused unless resumed
    results = ResultsLog(part_path(run_dir, ranks.rank, ranks.world), r.resume)
    task = build_task(spec.dataset, timeout_s=r.timeout_s)
    docs = select_docs(task, r.n_samples)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ranks.rank == 0:
        write_json(run_dir / "run.json", identity)
    # joining waits for every rank: none appends a record before all have checked the run dir (check_new)
    created = rk.start(ranks, spec.devices[0])
    try:
        return _run(cfg, run_dir, spec, ranks, task, docs, results)
    finally:
        rk.finish(created)


def _run(cfg: DictConfig, run_dir: Path, spec, ranks: rk.Ranks, task, docs: list[dict],
         results: ResultsLog) -> dict[str, Any]:
    """:func:`run` once the run dir is checked and the process group (several ranks) is up; returns the summary
    (rank 0; other ranks: {})."""
    r = spec.run
    set_tf32(r.tf32)
    threads = free_cores() if r.threads == "auto" else int(r.threads)  # before the model loads: the host at rest
    torch.set_num_threads(threads)
    torch.manual_seed(r.seed)
    lm = load_model(spec.model, spec.devices[0])
    tok = lm.tokenizer
    chat = spec.dataset.use_chat(lm.chat)
    target = CachedModel(lm.model, name=spec.model.name, cache=r.kv_cache, forward_impl=r.forward_impl)
    if r.forward_padding:  # this machine's measured forward costs (python -m pardec.bench cost), when there are some
        target.cost = CostTable.find(spec.model.name, spec.model.precision(), target.forward_impl,
                                     spec.model.attn_implementation)
        if target.cost is not None and ranks.rank == 0:
            log.info("verification forwards padded by %s's cost table (%s): %s", spec.model.name, target.cost.dtype,
                     {t: target.cost.cheapest_at_least(t) for t in sorted(target.cost.ms)})
    draft = (CachedModel(load_model(spec.draft, spec.devices[1]).model, name=f"draft:{spec.draft.name}", cache=r.kv_cache,
                         forward_impl=r.draft_forward_impl or r.forward_impl)
             if spec.draft else None)
    scorer = lm.model
    if spec.perplexity.get("enabled") and (spec.perplexity.get("model") or r.dtype == "int8"):
        # an int8 run's completions are scored by the fp32 model: perplexity then compares across dtypes
        dtype = scorer_dtype(r.dtype)
        name = spec.perplexity.get("model")
        scorer = load_model(named_config(name, dtype) if name else replace(spec.model, dtype=dtype)).model
    # the GPUs the models run on (their counters only: an idle GPU's energy is no generation's); RAPL: every package
    gpus = {p.device.index or 0 for m in (lm.model, draft.model if draft else None, scorer) if m is not None
            for p in m.parameters() if p.device.type == "cuda"}
    meter = EnergyMeter.create(spec.energy.get("enabled", True), gpus=sorted(gpus))
    if not meter.available and ranks.rank == 0:
        log.info("energy not measured: %s", meter.reason)
    device = rk.model_devices(lm.model)
    place = rk.record_place(ranks, device)
    mine = ranks.share(docs)

    roles = [("baseline", METHODS.canonical(spec.bench.baseline), {})]
    if spec.method != roles[0][1]:
        roles.append(("method", spec.method, spec.method_params))
    if spec.bench.include_hf:
        roles += [(role, name, {}) for role, name in PEERS.items()
                  if name not in (spec.method, roles[0][1]) and (draft is not None or not METHODS.get(name).needs_draft)]
    roles += spec.also
    def fresh_decoders(old: dict | None = None) -> dict:
        """Every role's decoder; given the ``old`` ones, new ones only for those that carry something from one
        generation to the next (:meth:`~pardec.decoding.base.Decoder.carried`): the others keep what their first
        generations built (a compiled DFlash round's graph)."""
        return {role: old[role] if old is not None and old[role].carried() is None
                else build_decoder(name, target, tok, draft, **params) for role, name, params in roles}

    decoders = fresh_decoders()
    method_role = "method" if len(roles) > 1 and roles[1][0] == "method" else "baseline"
    eos = lm.eos_ids if r.stop_at_eos else set()
    stopper = Stopper(tok, eos, task.stop_strings(chat))

    batch = None
    if r.batch_size > 1:  # every role decodes its prompts as one batch (pardec.evaluation.batched)
        batch = run_roles(spec, task, mine, roles, lm, draft.model if draft is not None else None,
                          scorer if spec.perplexity.get("enabled") else None, completion_nll, stopper, chat, results,
                          place, target.max_length)
        mine = []  # (no prompt-by-prompt loop)
    if mine and spec.bench.warmup:  # every rank warms up, on its first prompt
        warm_ids = task.prompt_ids(mine[0][1], tok, chat, [])
        try:
            for _ in range(spec.bench.warmup):  # interleaved, like the timed loop
                for dec in decoders.values():
                    dec.generate(warm_ids, spec.bench.warmup_tokens, stopper, spec.sampling)
        except NonFiniteLogitsError as e:  # the prompts will record it; the warm-up just ends
            log.warning("warm-up stopped: %s", e)
        # the warm-up prompt is the first timed one: decoders that keep state across prompts (Ouroboros's
        # warm_start pool) must not start the timed run with what they learnt from it
        decoders = fresh_decoders(decoders)

    desc = f"{spec.method} on {spec.dataset.name}" + (f" [rank {ranks.rank}/{ranks.world}]" if ranks.multi else "")
    bar = tqdm(mine, desc=desc, unit="prompt", dynamic_ncols=True, position=ranks.rank if ranks.multi else None)
    for i, doc in bar:  # i: the document's index in the whole run (sampling seeds depend on it, not on the rank)
        # what decoders carry across prompts (Ouroboros's warm_start pool): every repeat of a prompt starts from the
        # state before its first, and the next prompt continues from the state after the first, as with repeats=1
        before: dict[str, Any] = {}
        after: dict[str, Any] = {}
        for rep in range(r.repeats):
            sampling = spec.sampling if spec.sampling.greedy else SamplingConfig(
                **{**asdict(spec.sampling), "seed": spec.sampling.seed + 100_003 * rep + i})
            for role, name, _ in roles:
                if results.done(doc["id"], role, rep):
                    continue
                if r.repeats > 1:
                    if rep == 0:
                        before[role] = decoders[role].carried()
                    elif before.get(role) is not None:
                        decoders[role].restore(before[role])
                try:
                    rec = run_document(task, doc, decoders[role], tok, chat, stopper, sampling, r.max_new_tokens,
                                       target.max_length, scorer if spec.perplexity.get("enabled") else None,
                                       completion_nll, meter=meter)
                except NonFiniteLogitsError as e:  # this prompt stops here, the run goes on
                    rec = {"error": str(e)}
                if r.repeats > 1 and rep == 0:
                    after[role] = decoders[role].carried()
                if (where := non_finite(rec)) is not None:
                    rec = {**finite(rec), "error": f"non-finite {where} (NaN/inf)"}
                rec.update(id=doc["id"], method=name, role=role, repeat=rep, **place)
                base = results.done(doc["id"], "baseline", rep)
                if role != "baseline" and base is not None and not is_failed(rec) and not is_failed(base):
                    rec["equal_to_baseline"] = rec["turn_tokens"] == base["turn_tokens"]
                    rec["first_divergence"] = first_divergence(rec["tokens"], base["tokens"])
                    if not rec["equal_to_baseline"] and spec.sampling.greedy:  # after the timed generation
                        rec.update(finite(divergence_logits(lm.model, task, doc, tok, chat, rec, base)))
                results.append(rec)
        for role, state in after.items():
            if state is not None:
                decoders[role].restore(state)
        bar.set_postfix_str(running_speed(results.records, method_role))
    bar.close()

    # several ranks: wait for all (each hands over what it ran on), then rank 0 alone merges and reports
    infos = rk.gather(ranks, {**rk.rank_info(ranks, device), "energy": meter.status()})
    if ranks.rank != 0:
        return {}
    records = results.records
    energy = meter.status()
    if ranks.multi:
        index = {d["id"]: i for i, d in enumerate(docs)}
        role_pos = {role: k for k, (role, _, _) in enumerate(roles)}
        records = merge_parts(run_dir, ranks.world, lambda x: (index.get(x["id"], len(index)), x.get("repeat", 0),
                                                               role_pos.get(x["role"], len(role_pos))))
        energy = rk.combined_energy([x.pop("energy") for x in infos], [x["host"] for x in infos])
    summary = summarize(spec, task, records, method_role, lm.model.config, energy=energy)
    # whether bf16 linears ran prepacked for oneDNN (model.cpu_prepack, on CPUs with AMX-bf16)
    summary["prepacked_linears"] = {"target": is_packed(lm.model),
                                    "draft": is_packed(draft.model) if draft is not None else None}
    # the forward-cost table that padded the target's forwards and fed the cost-aware methods (its key names the
    # forward it was measured on: pardec.models.cost.table_key), None without one
    summary["cost_table"] = target.cost.dtype if target.cost is not None else None
    # the forwards that ran (``auto`` resolved for each model where its weights are: CachedModel)
    summary["forward_impl"] = target.forward_impl
    summary["draft_forward_impl"] = draft.forward_impl if draft is not None else None
    if ranks.multi:
        counts: dict[int | None, int] = {}
        for x in records:
            counts[x.get("rank")] = counts.get(x.get("rank"), 0) + 1
        summary["world_size"] = ranks.world
        summary["ranks"] = [{**x, "records": counts.get(x["rank"], 0)} for x in infos]
        summary["peak_rss_mb"] = max(x["peak_rss_mb"] for x in infos)
        if any("peak_cuda_mb" in x for x in infos):
            summary["peak_cuda_mb"] = max(x.get("peak_cuda_mb", 0.0) for x in infos)
    summary["threads"], summary["threads_setting"] = threads, r.threads
    if batch is not None:
        summary["batch"] = batch
    summary = finite(summary)
    write_json(run_dir / "summary.json", summary)
    print(format_table(summary))
    group = None
    try:
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            group = Path(hc.sweep.dir).name
    except ValueError:  # not running under Hydra (a direct call from Python)
        pass
    with Tracker(spec.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), spec.method, group=group,
                 name=f"{spec.method}-{spec.dataset.name}-{spec.model.name}-{spec.model.dtype}") as tr:
        tr.log_summary(summary)
        tr.log_table("per_prompt", [{k: v for k, v in rec.items() if k not in ("tokens", "turn_tokens", "accepted")}
                                    for rec in records])
    return summary


def divergence_logits(model, task, doc, tok, chat, rec: dict, base: dict) -> dict[str, Any]:
    """Where ``rec``'s tokens first differ from the baseline record ``base``: the target ``model``'s two highest
    next-token logits there, from one teacher-forced forward (no cache, no gradient, in the model's dtype on its
    input device) -> ``divergence_margin`` (top-1 minus top-2) and ``divergence_top`` ([[id, logit], [id, logit]]).

    The context is what both decoders had seen when they parted: the prompt of the first turn whose tokens differ
    (multi-turn tasks such as MT-Bench build it from the earlier turns' answers, which are then equal in both
    records: the baseline's ``text``) plus the baseline's tokens of that turn before the first differing one. A
    record that stops earlier than the baseline (or later) parts where the shorter one ends."""
    turns, base_turns = rec["turn_tokens"], base["turn_tokens"]
    t = next(k for k in range(max(len(turns), len(base_turns)))
             if k >= len(turns) or k >= len(base_turns) or turns[k] != base_turns[k])
    texts = base["text"] if isinstance(base["text"], list) else [base["text"]]
    mine, theirs = (turns[t] if t < len(turns) else []), (base_turns[t] if t < len(base_turns) else [])
    j = first_divergence(mine, theirs)
    ids = list(task.prompt_ids(doc, tok, chat, texts[:t])) + list(theirs[:j])
    device = model.get_input_embeddings().weight.device
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False, **extra).logits[0, -1]
        values, top = logits.topk(2)
        v, i = values.float().tolist(), top.tolist()  # one read-back each
    return {"divergence_margin": v[0] - v[1], "divergence_top": [[i[0], v[0]], [i[1], v[1]]]}


def run_document(task, doc, dec, tok, chat, stopper, sampling, max_new, max_len, scorer, completion_nll,
                 meter=None, cpu=None) -> dict:
    """All turns of one document with one decoder -> a results.jsonl record (without id/role). ``meter`` (an
    :class:`~pardec.metrics.energy.EnergyMeter`, None = not measured) measures each ``generate`` call: ``energy_j``
    is their sum, None if any turn was not measured; ``energy_by_device`` its split ({} when not measured).
    ``cpu`` (a :class:`~pardec.metrics.busy.CpuMeter`) reads what other processes took of the CPU meanwhile:
    ``others_cores``, ``steal_cores`` and ``busy`` (:mod:`pardec.metrics.busy`)."""
    meter = meter or EnergyMeter()  # a meter without a monitor: every reading is None
    cpu = cpu or CpuMeter()
    contention = Contention(0.0, 0.0, 0.0, 0.0)  # summed over the turns; None parts where not measured
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
        with meter.window(getattr(dec, "name", "generate")) as reading, cpu.window() as competed:
            res = dec.generate(ids, max_new, stopper, sampling)
        contention += competed
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
        "equal_to_baseline": None, "first_divergence": None, "divergence_margin": None, "divergence_top": None,
        "score": task.score(doc, history),
        "nll": nll if scorer is not None else None, "nll_tokens": n_nll,
        "energy_j": sum(energy) if measured else None, "energy_by_device": by_device if measured else {},
        "extras": {k: statistics.fmean(e[k] for e in extras if k in e) for k in extras[0]} if extras else {},
        **contention.record(),
    }


def _scalar_extras(extras: dict) -> dict:
    return {k: v for k, v in extras.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
