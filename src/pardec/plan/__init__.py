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
* frozen: the frozen teacher (kind draft, ``trainer.teacher=online``) or base (kind drafter) in the run's ``dtype``,
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
would hold it ("2 GPUs"). ``--stages`` adds a training recipe's data-generation stages (completions, CLLM's
trajectories, held-out completions: :mod:`pardec.plan.data_stages`), a row each. Not planned: CPU recipes.
"""

from __future__ import annotations

from pardec.plan.cli import _fit_cell, keep_result, main, table, table_rows
from pardec.plan.compose import check_name, compose, launch_world, matching, paper_recipes
from pardec.plan.data_stages import data_plans, stage_plans
from pardec.plan.formulas import LOSS_PEAK, layer_activations, loss_logits, stack_activations
from pardec.plan.plans import plan, prompt_estimate
from pardec.plan.shapes import (
    CAPACITIES_GB,
    COMPONENTS,
    CONTEXT_MARGIN,
    DTYPE_BYTES,
    GB,
    OVERHEAD,
    Arch,
    Plan,
    arch,
    draft_params,
    drafter_params,
    lora_params,
)
from pardec.recipes import recipes

__all__ = ["CAPACITIES_GB", "COMPONENTS", "CONTEXT_MARGIN", "DTYPE_BYTES", "GB", "LOSS_PEAK", "OVERHEAD", "Arch", "Plan",
           "_fit_cell", "arch", "check_name", "compose", "data_plans", "draft_params", "drafter_params", "keep_result",
           "launch_world", "layer_activations", "lora_params", "loss_logits", "main", "matching", "paper_recipes",
           "plan", "prompt_estimate", "recipes", "stack_activations", "stage_plans", "table", "table_rows"]
