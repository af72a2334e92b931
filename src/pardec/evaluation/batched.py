"""``evaluate ... batch_size=B``: every role decodes all its prompts as one batched run (continuous batching over B
rows, :mod:`pardec.decoding.batch`) instead of prompt by prompt. The roles run one after another, baseline first;
multi-turn tasks (MT-Bench) run turn by turn (every prompt's turn 2 after all turns 1, each with its own history).

Each prompt's record is the one :func:`~pardec.evaluation.loop.run_document` writes, appended as the prompt's last
turn finishes (a killed run resumes: finished prompts are kept, the others decode again as a batch), with the times
batching gives a request: ``wall_s`` its latency from the batch's submission to its last token (summed over turns),
``prefill_s`` to its first token; plus ``batch_size``, and the CPU contention measured over the whole batch. The
summary gets ``batch``: per role, its tokens/s over the whole run and the latency mean / p50 / p95."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tqdm import tqdm

from pardec.config import ConfigError
from pardec.decoding.batch import build_batched, run_batch
from pardec.decoding.batch.engine import check_batched, latency
from pardec.evaluation.results import finite, first_divergence, is_failed, non_finite
from pardec.metrics.busy import CpuMeter
from pardec.models.ragged import BATCH_FORWARDS


def batch_forward(forward_impl: str) -> str:
    """The ragged batch's forward for a run's ``forward_impl`` (auto: the lean one)."""
    return "lean" if forward_impl == "auto" else forward_impl


def check(spec) -> None:
    """What ``batch_size > 1`` needs, before anything loads (one line each)."""
    r = spec.run
    if r.batch_size == 1:
        return
    if spec.bench.include_hf:
        raise ConfigError(f"batch_size={r.batch_size}: bench.include_hf=true adds transformers' decoders, which decode "
                          f"one prompt at a time; set bench.include_hf=false")
    if r.repeats != 1:
        raise ConfigError(f"batch_size={r.batch_size} with repeats={r.repeats}: a batched run times the whole batch "
                          f"once; set repeats=1")
    check_forward(spec, f"batch_size={r.batch_size}")
    if spec.model.attn_implementation not in ("sdpa", "eager", "invariant"):  # (invariant: pardec.models.ragged's)
        raise ConfigError(f"batch_size={r.batch_size} runs pardec's lean forward over a ragged batch cache, which "
                          f"takes model.attn_implementation sdpa, eager or invariant, not "
                          f"{spec.model.attn_implementation!r}")
    for where, name, params in [("bench.baseline", spec.bench.baseline, {}), ("method", spec.method,
                                                                               spec.method_params),
                                *((f"bench.also entry {role[5:]!r}", name, params) for role, name, params in spec.also)]:
        try:
            check_batched(name, r.batch_size, params, spec.sampling)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def check_forward(spec, what: str) -> None:
    """The forwards a ragged batch runs (``what`` names the run in the message), before anything loads."""
    r = spec.run
    if r.forward_impl not in ("auto", *BATCH_FORWARDS) or (r.draft_forward_impl or "auto") not in ("auto", "lean"):
        raise ConfigError(f"{what} runs pardec's lean, compiled or cudagraph forward over a ragged batch cache (a "
                          f"draft model the lean one); forward_impl={r.forward_impl} / draft_forward_impl="
                          f"{r.draft_forward_impl} are batch-1 forwards: leave them at auto, or forward_impl=compiled")
    if r.forward_impl in ("compiled", "cudagraph") and spec.model.attn_implementation == "invariant":
        raise ConfigError(f"{what} with forward_impl={r.forward_impl} and model.attn_implementation=invariant: the "
                          f"invariant attention reads its plan on the host every forward and does not compile; use "
                          f"one or the other")


def run_roles(spec, task, mine: list, roles: list, lm, draft_model, scorer, completion_nll, stopper, chat, results,
              place: dict, max_len: int) -> dict[str, Any]:
    """Decode every not yet recorded prompt of ``mine`` ((index, doc) pairs) with every role as a batch; append a
    record per prompt; returns the summary's ``batch`` entry."""
    r = spec.run
    out: dict[str, Any] = {"batch_size": r.batch_size, "roles": {}}
    for role, name, params in roles:
        todo = [doc for _, doc in mine if not results.done(doc["id"], role, 0)]
        if not todo:
            continue
        histories: dict[str, list[str]] = {doc["id"]: [] for doc in todo}
        turns: dict[str, list] = {doc["id"]: [] for doc in todo}
        prompts: dict[str, list[list[int]]] = {doc["id"]: [] for doc in todo}
        skipped: dict[str, str] = {}
        wall = tokens = 0.0
        latencies: list[float] = []
        contention = None
        first = [list(task.prompt_ids(doc, lm.tokenizer, chat, [])) for doc in todo]
        dec = build_batched(name, lm.model, r.batch_size, max(map(len, first)) + r.max_new_tokens + 64, lm.tokenizer,
                            draft_model, batch_forward(r.forward_impl), **params)  # (its cache grows for longer turns)
        if spec.bench.warmup:  # the batch's first prompts, a few tokens, untimed
            run_batch(dec, first[: r.batch_size], spec.bench.warmup_tokens, stopper, spec.sampling)
        bar = tqdm(total=len(todo) * task.n_turns, desc=f"{name} on {spec.dataset.name} (batch {r.batch_size})",
                   unit="turn", dynamic_ncols=True)
        for turn in range(task.n_turns):
            sampling = spec.sampling if spec.sampling.greedy or not turn else replace(
                spec.sampling, seed=spec.sampling.seed + 100_003 * turn)  # (each turn its own draws)
            live = [doc for doc in todo if doc["id"] not in skipped]
            ids = []
            for doc in live:
                p = list(task.prompt_ids(doc, lm.tokenizer, chat, histories[doc["id"]]))
                if len(p) + r.max_new_tokens > max_len:
                    skipped[doc["id"]] = (f"prompt of {len(p)} tokens + max_new_tokens {r.max_new_tokens} exceeds the "
                                          f"model's context of {max_len} tokens")
                ids.append(p)
            pairs = [(doc, p) for doc, p in zip(live, ids) if doc["id"] not in skipped]
            if not pairs:
                continue
            with CpuMeter().window() as competed:
                run = run_batch(dec, [p for _, p in pairs], r.max_new_tokens, stopper, sampling,
                                on_finish=lambda _res, bar=bar: bar.update())
            contention = competed if contention is None else contention + competed
            wall += run.wall_s
            tokens += run.tokens
            for (doc, p), res in zip(pairs, run.results):
                turns[doc["id"]].append(res)
                prompts[doc["id"]].append(p)
                histories[doc["id"]].append(stopper.final_text(res.tokens))
        bar.close()
        for doc in todo:
            rec = ({"skipped": skipped[doc["id"]]} if doc["id"] in skipped else
                   _record(task, doc, turns[doc["id"]], prompts[doc["id"]], histories[doc["id"]], scorer,
                           completion_nll, contention))
            latencies += [rec["wall_s"]] if "wall_s" in rec else []
            _append(results, rec, doc, name, role, place, r.batch_size)
        out["roles"][role] = {"method": name, "tokens_per_s": tokens / wall if wall else None, "wall_s": wall,
                              "tokens": int(tokens), "latency": latency(latencies)}
    return out


def _record(task, doc, results: list, prompts: list, history: list[str], scorer, completion_nll, contention
            ) -> dict[str, Any]:
    nll = n_nll = 0.0
    if scorer is not None:
        for p, res in zip(prompts, results):
            s, n = completion_nll(scorer, p, res.tokens)
            nll, n_nll = nll + s, n_nll + n
    flat = [t for res in results for t in res.tokens]
    return {
        "n_tokens": len(flat), "tokens": flat, "turn_tokens": [res.tokens for res in results],
        "text": history[0] if len(history) == 1 else history,
        "target_forwards": sum(res.target_forwards for res in results), "draft_forwards": 0,
        "accepted": [a for res in results for a in res.accepted],
        "wall_s": sum(res.total_s for res in results), "prefill_s": sum(res.prefill_s for res in results),
        "draft_s": 0.0, "drafted": sum(res.drafted for res in results),
        "draft_accepted": sum(res.draft_accepted for res in results),
        "equal_to_baseline": None, "first_divergence": None, "divergence_margin": None, "divergence_top": None,
        "score": task.score(doc, history), "nll": nll if scorer is not None else None, "nll_tokens": int(n_nll),
        "energy_j": None, "energy_by_device": {}, "extras": {},
        **(contention.record() if contention is not None else {}),
    }


def _append(results, rec: dict, doc: dict, name: str, role: str, place: dict, batch_size: int) -> None:
    if (where := non_finite(rec)) is not None:
        rec = {**finite(rec), "error": f"non-finite {where} (NaN/inf)"}
    rec.update(id=doc["id"], method=name, role=role, repeat=0, batch_size=batch_size, **place)
    base = results.done(doc["id"], "baseline", 0)
    if role != "baseline" and base is not None and not is_failed(rec) and not is_failed(base):
        rec["equal_to_baseline"] = rec["turn_tokens"] == base["turn_tokens"]
        rec["first_divergence"] = first_divergence(rec["tokens"], base["tokens"])
    results.append(rec)
