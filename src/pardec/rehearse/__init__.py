"""Rehearse the paper recipes on the CPU: every stage, as configured, with tiny random models of the same family.

    python -m pardec.rehearse --list                  the paper recipes found, and what each rehearsal overrides
    python -m pardec.rehearse cllm_gsm8k mjsd_llama2_13b_cnn_dm [--ranks 2] [--out DIR] [--json FILE]
    python -m pardec.rehearse --all                   every one (``make rehearse``)

A paper recipe is a training experiment (``conf/experiment/``) or an evaluation recipe (``conf/recipe/``) whose
target is a real model (not ``tiny_random`` / ``smollm2_135m``). Its rehearsal launches the recipe's own command,
``python -m torch.distributed.run --standalone --nproc_per_node <ranks> -m train +experiment=<name> stage=all`` (or
``-m evaluate +recipe=<name>``), on gloo ranks, with the recipe's config unchanged except for what is listed per
recipe (``--list``):

* model: the target (and an evaluation's draft) swapped for a tiny random Llama (hidden 64, 2 layers; the real
  model's number of layers, ``conf/model_configs/<hub id>/config.json``, where the recipe names layer indices: the
  draft kind's layers, FIRP's layers); a target split with ``model.device_map`` is a tiny random model saved to disk first
  (``model=local``; 8 layers of hidden 128, so that layers, not embeddings, make it up), its ``device_map`` kept;
* device: training takes ``device=cpu`` (the GPU recipes' switch); ``threads=1`` (one torch thread per rank). An
  evaluation keeps its devices and forward and runs as on GPUs, under :mod:`pardec.testing.virtual_gpus`: one
  virtual CUDA device per rank, where ``forward_impl=auto`` picks ``cudagraph`` (its graphs replayed by an eager
  stand-in); a target split with ``model.device_map`` gets two per rank, each saying it has 0.9x the tiny target's
  loaded size free, so accelerate's ``auto`` map splits it between them as it splits a 34B target over two GPUs,
  and ``auto`` picks the ``hf`` forward;
* data: small local files written into the rehearsal's work dir (``dataset.path`` and the data sections' sources);
* sizes: a few prompts or documents, a few new tokens, ``trainer.max_steps=2``.

The DeepSpeed stage (ZeRO-2/3), the losses, the stages, the decoding method and its parameters, dtypes and every
other key stay as the recipe says (``tests/test_rehearse.py`` composes both and diffs them). Each launch is checked:
training writes ``train_summary.json`` with every stage of its kind, a non-empty ``final/`` and complete merged data
(every prompt's record); evaluation writes ``summary.json`` with ``n_samples`` prompts and ``exact_match_rate``,
every rank's target on CUDA (on two devices where it is split).
"""

from __future__ import annotations

from pardec.rehearse.cli import main
from pardec.rehearse.data import LOCAL_ALREADY, write_data
from pardec.rehearse.discovery import (
    SMALL_MODELS,
    Recipe,
    compose,
    config_diff,
    discover,
    find,
    flatten,
    real_layers,
    swapped,
)
from pardec.rehearse.plans import Plan, deepspeed_stage, plan, stages_of
from pardec.rehearse.report import host, render, table
from pardec.rehearse.running import Result, check, launch_cmd, prepare, rehearse

__all__ = ["LOCAL_ALREADY", "SMALL_MODELS", "Plan", "Recipe", "Result", "check", "compose", "config_diff",
           "deepspeed_stage", "discover", "find", "flatten", "host", "launch_cmd", "main", "plan", "prepare",
           "real_layers", "rehearse", "render", "stages_of", "swapped", "table", "write_data"]
