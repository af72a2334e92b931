"""Kind ``cllm``: consistency LLMs (Kou et al. 2024), ``python -m train +experiment=cllm_<name>``.

Stages (``stage=collect|generate|train|eval|all``):

* ``collect``: Jacobi trajectories of ``model`` on ``dataset`` into ``collect.out_dir`` (:mod:`.collect`, schema in
  :mod:`.trajectories`; default ``${paths.data_dir}/trajectories/<experiment>``); resumable: rerun the same command
  after a kill; sharded over ranks by prompt index, merged by rank 0;
* ``generate``: the teacher's whole greedy answers (``completions.sources``: by default the collection's dataset
  and ``max_prompts``, up to EOS or ``completions.max_new_tokens``) into ``completions.out_dir``, the completions
  corpus every kind shares (:mod:`pardec.training.completions`, its schema there; resumable, sharded like
  ``collect``). Only with ``ar_answer: whole`` (the default) and ``completions.max_new_tokens >
  collect.max_new_tokens``, i.e. when the collection stops before the answers end; otherwise it does nothing;
* ``train``: :class:`~.trainer.CLLMTrainer` on ``<train_data>/trajectories.jsonl`` (``train_data`` defaults to
  ``collect.out_dir``; samples and collator in :mod:`.data`), the AR rows holding the teacher's whole answers
  (``ar_answer``, :mod:`.answers`: collected answers extended from the corpus, matched by prompt ids); the final
  model (LoRA merged) and tokenizer go to ``<run dir>/final``, loadable with ``python -m evaluate +method=jacobi
  model=local model.path=<run dir>/final``;
* ``eval``: held-out Jacobi decoding with ``<run dir>/final`` (``eval.sources``; :mod:`.evaluate`): its fast-forward
  and tokens per forward per source, into ``<run dir>/cllm_eval.json``. Without ``eval.sources`` ``stage=all``
  skips it and ``stage=eval`` is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pardec.config import ConfigError, DatasetConfig, check_types, to_dataclass
from pardec.jsonl import read_json
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model, trainable
from pardec.training import stages
from pardec.training.base import apply_lora, fit, save_final, training_args
from pardec.training.cllm.answers import check_ar_answer, whole_answers
from pardec.training.cllm.collect import CollectConfig, collect, collection_meta, prompts_from_dataset
from pardec.training.cllm.data import CLLMCollator, TrajectoryDataset
from pardec.training.cllm.evaluate import EvalConfig, eval_config, evaluate_cllm
from pardec.training.cllm.trainer import CLLMConfig, CLLMTrainer, DecodingProxy
from pardec.training.cllm.trajectories import load_trajectories
from pardec.training.completions import (
    check_settings,
    generate_config,
    generate_stage,
    generation_meta,
    with_corpus_topk,
)
from pardec.training.kinds import Kind, Spec, common_fields, register_kind

log = logging.getLogger(__name__)


def last_evaluation(trainer) -> dict[str, Any]:
    """The proxy's metrics after the last optimizer step: those the Trainer logged at that step (with
    ``eval_strategy: steps`` it evaluates the final step itself), else a new evaluation. One proxy evaluation costs
    ~45-70 s in the CPU recipe on 2 cores (measured 2026-11-27)."""
    step = trainer.state.global_step
    for entry in reversed(trainer.state.log_history):
        if entry.get("step") != step:
            break
        if any(k.startswith("eval_") for k in entry):
            return {k: v for k, v in entry.items() if k.startswith("eval_")}
    return trainer.evaluate()


@dataclass
class CLLMSpec(Spec):
    dataset: DatasetConfig
    collect: CollectConfig
    train_data: Path
    ar_answer: str  # whole | collected (pardec.training.cllm.answers)
    ar_clean: bool  # drop records whose whole AR answer loops (collect.clean's rule; default: collect.clean)
    gen: Any  # pardec.training.completions.GenerateConfig: the teacher's whole answers (stage generate)
    eval: EvalConfig  # stage eval: held-out Jacobi decoding


@register_kind("cllm")
class CLLMKind(Kind):
    name = "cllm"
    stages = ("collect", "generate", "train", "eval")
    rank0_stages = ("eval",)
    example = "cllm_tiny"

    def validate(self, cfg: DictConfig, name: str) -> CLLMSpec:
        _, completions = self.sections(cfg, "collect", "completions")
        ar_clean = cfg.get("ar_clean", cfg.collect.get("clean", False))
        check_types(CLLMSpec, {"ar_clean": ar_clean}, "")
        ev = eval_config(OmegaConf.to_container(cfg.eval, resolve=True) if "eval" in cfg else None)
        if cfg.get("stage") == "eval" and not ev.sources:
            raise ConfigError("stage=eval needs held-out prompts: eval.sources is empty (list at least one "
                              "{dataset: {name: ...}, max_prompts: N})")
        return CLLMSpec(**common_fields(cfg, name, CLLMConfig, lora=True),
                        dataset=to_dataclass(DatasetConfig, cfg.dataset, "dataset"),
                        collect=to_dataclass(CollectConfig, cfg.collect, "collect"),
                        train_data=Path(cfg.get("train_data") or cfg.collect.out_dir),
                        ar_answer=check_ar_answer(cfg.get("ar_answer", "whole")),
                        ar_clean=ar_clean,
                        gen=generate_config(completions, "completions"), eval=ev)

    def stage_collect(self, spec: CLLMSpec, run_dir: Path, ranks) -> dict | None:
        # the model (its weights, dtype, chat template choice) and the dataset (source, split, prompt style, extra)
        # fix the prompts and the EOS ids; a resumed collection must match them (checked now, before the model loads)
        identity = {"model": spec.model.identity(), "dataset": asdict(spec.dataset)}
        stages.check_settings(spec.collect.out_dir, collection_meta(spec.collect, identity, set()),
                              spec.collect.overwrite, "collect", "trajectories collected", ignore=("eos_ids",))
        barrier = ranks.barrier()
        lm = load_model(spec.model)
        prompts = prompts_from_dataset(spec.dataset, lm.tokenizer, lm.chat, spec.collect.max_prompts)
        eos = lm.eos_ids
        meta = collection_meta(spec.collect, identity, eos)
        log.info("collecting trajectories of %d prompts into %s (rank %d of %d)", len(prompts), spec.collect.out_dir,
                 ranks.rank, ranks.world)
        # returns on every rank once rank 0 has merged: every rank may read trajectories.jsonl then
        stats = collect(spec.collect, CachedModel(lm.model), eos, prompts, meta, ranks.rank, ranks.world, barrier)
        if stats is not None:
            log.info("trajectories: %s", json.dumps(stats))
        return stats

    def stage_generate(self, spec: CLLMSpec, run_dir: Path, ranks) -> dict | None:
        if spec.ar_answer != "whole":
            why = f"ar_answer={spec.ar_answer}: the AR rows hold the collected answers"
        elif spec.gen.max_new_tokens <= spec.collect.max_new_tokens:
            why = (f"completions.max_new_tokens={spec.gen.max_new_tokens} <= collect.max_new_tokens="
                   f"{spec.collect.max_new_tokens}: the collected answers already are whole")
        else:
            why = None
        if why:
            log.info("stage generate: nothing to generate (%s)", why)
            return {"skipped": why}
        # a resumed generation must match the settings (checked now, before the model loads; EOS ids after)
        gen = with_corpus_topk(spec.gen)
        check_settings(gen, generation_meta(gen, spec.model.identity(), set()), ignore=("eos_ids",))
        return generate_stage(spec.gen, spec.model, ranks)  # returns once rank 0 has merged, on every rank

    def stage_train(self, spec: CLLMSpec, run_dir: Path, ranks) -> dict[str, Any]:
        stats_file = spec.train_data / "stats.json"
        if stats_file.is_file() and not read_json(stats_file).get("complete", True):
            raise ConfigError(f"{spec.train_data} holds an unfinished collection ({stats_file}); "
                              f"finish it first: rerun with stage=collect")
        args = training_args(CLLMConfig, spec, run_dir)  # before the model, as ZeRO-3 requires
        records = load_trajectories(spec.train_data)
        if args.proxy_records >= len(records):
            raise ConfigError(f"trainer.proxy_records={args.proxy_records} leaves nothing to train on: "
                              f"{spec.train_data} holds {len(records)} records")
        held = records[len(records) - args.proxy_records :] if args.proxy_records else []  # the last ones, by index
        records = records[: len(records) - len(held)]
        answers: dict[str, Any] = {"ar_answer": spec.ar_answer}
        if spec.ar_answer == "whole":  # the AR rows: the teacher's whole answers (the proxy needs none)
            c = spec.collect
            records, answers = whole_answers(records, spec.train_data, spec.gen.out_dir, spec.gen.max_new_tokens,
                                             (c.clean_max_ngram, c.clean_max_repeats) if spec.ar_clean else None)
            log.info("AR answers: %s", json.dumps(answers))
            if not records:
                raise ConfigError(f"no trajectory record of {spec.train_data} is left to train on: "
                                  f"{json.dumps(answers)}")
        lm = load_model(trainable(spec.model, spec.model_dtype))  # the Trainer places it
        model = apply_lora(lm.model, spec.lora) if spec.lora else lm.model
        ds = TrajectoryDataset(records, args.loss_type, args.state_sampling, args.max_length, args.seed,
                               args.states_per_sample, args.ar_tail)
        proxy = TrajectoryDataset(held, "global", "all", args.max_length) if held else None
        decode = DecodingProxy([r["prompt_ids"] for r in held], spec.collect.block_size, spec.collect.max_new_tokens,
                               lm.eos_ids) if held and args.proxy_decode else None
        trainer = CLLMTrainer(model=model, args=args, train_dataset=ds, eval_dataset=proxy, decoding_proxy=decode,
                              data_collator=CLLMCollator(lm.tokenizer.pad_token_id), processing_class=lm.tokenizer)

        def finish(final: Path, trained: dict) -> dict[str, Any]:
            final_proxy = last_evaluation(trainer) if proxy is not None else {}  # the proxy after the last step
            save_final(trainer, spec, run_dir, final, ranks)
            return {**final_proxy, "samples": len(ds), "truncated_samples": ds.n_truncated, "records": len(records),
                    "proxy_records": len(held), "ar_answers": answers, "final_model": str(final)}

        return fit(trainer, spec, run_dir, ranks, finish)

    def stage_eval(self, spec: CLLMSpec, run_dir: Path, ranks) -> dict[str, Any]:
        if not spec.eval.sources:  # stage=all without held-out prompts (stage=eval is refused in validate)
            log.info("stage eval: nothing to evaluate (eval.sources is empty)")
            return {"skipped": "eval.sources is empty"}
        out = evaluate_cllm(spec, run_dir)
        print(json.dumps(out, indent=2))
        return out
