"""What ``dtype=int8`` does to a model's predictions, per int8 recipe (``model.int8_weights`` / ``int8_smooth`` /
``int8_skip``): teacher-forced on
a corpus of the fp32 target's own greedy completions (``stage=generate`` / the draft recipe's eval corpora), how
often the int8 target's argmax is the fp32 target's token, the perplexity of those tokens under it, and, with a
draft, how often the int8 draft's argmax equals the int8 target's (what speculative decoding at int8 accepts).

    python scripts/int8_quality.py --corpus data/completions/draft_smollm2/eval/gsm8k \\
        [--corpus data/completions/draft_smollm2/eval/humaneval] [--model smollm2_135m] \\
        [--draft outputs/train/runs/draft_smollm2/default/final] [--recipe per_channel:smooth=0.8:skip=down_proj ...] \\
        [--max-records 40] [--threads 2] [--out outputs/int8_quality.json]

A recipe is ``<scheme>[:smooth=<alpha>][:skip=<name>+<name>]`` (default: weight_only, per_tensor, per_channel,
per_channel:smooth=0.8, per_channel:smooth=0.8:skip=down_proj, per_token:smooth=0.5; smoothing applies to the
schemes that quantize activations), or
``bf16`` (``dtype=bf16``, the same questions for the bf16 model: the other approximate CPU mode). fp32 is the first row (its agreement with its own records is 1 by construction; the draft row is fp32 draft vs fp32
target). Prints the CPU model and vector flags first. No timing: run it beside other jobs if you must.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from pardec.config import ModelConfig
from pardec.metrics.perplexity import completion_nll
from pardec.models.host import describe, machine
from pardec.models.loading import load_model, named_config
from pardec.models.quant.int8 import parse_recipe
from pardec.training.completions import load_completions
from pardec.training.draft.trainer import agreement


@torch.inference_mode()
def record_nll(model, records: list[dict]) -> tuple[float, int]:
    """(summed negative log-likelihood, positions) of the records' completion tokens under ``model``."""
    parts = [completion_nll(model, r["prompt_ids"], r["completion_ids"]) for r in records]
    return sum(x for x, _ in parts), sum(n for _, n in parts)


DEFAULT_RECIPES = ("weight_only", "per_tensor", "per_channel", "per_channel:smooth=0.8",
                   "per_channel:smooth=0.8:skip=down_proj", "per_token:smooth=0.5")


def _config(base: ModelConfig, dtype: str, recipe: dict) -> ModelConfig:
    from dataclasses import replace

    return replace(base, dtype=dtype, device="cpu", **recipe)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", action="append", required=True, help="a completions dir (repeatable)")
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name, or tiny_random")
    ap.add_argument("--draft", default=None, help="a saved draft dir (optional)")
    ap.add_argument("--recipe", action="append", default=None, help="an int8 recipe, or bf16 (repeatable; see above)")
    ap.add_argument("--max-records", type=int, default=40, help="the first N records of each corpus")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    a = ap.parse_args(argv)
    try:
        recipes = {r: ("bf16", {}) if r == "bf16" else ("int8", parse_recipe(r)) for r in (a.recipe or DEFAULT_RECIPES)}
    except ValueError as e:
        ap.error(f"--recipe: {e}")
    if a.max_records < 1:
        ap.error(f"--max-records {a.max_records}: it must be >= 1")
    torch.set_num_threads(a.threads)
    print(describe(machine()))
    corpora = {Path(c).name: load_completions(c)[: a.max_records] for c in a.corpus}
    base = (ModelConfig(name="tiny_random", source="tiny_random") if a.model == "tiny_random"
            else named_config(a.model, "fp32"))
    draft_base = ModelConfig(name="draft", source="local", path=a.draft) if a.draft else None
    rows = []
    for label, dtype, recipe in [("fp32", "fp32", {})] + [(r if d == "bf16" else f"int8 {r}", d, x)
                                                          for r, (d, x) in recipes.items()]:
        lm = load_model(_config(base, dtype, recipe))
        pad = lm.tokenizer.pad_token_id
        draft = load_model(_config(draft_base, dtype, recipe)).model if draft_base else None
        row = {"label": label, "corpora": {}}
        for name, records in corpora.items():
            nll, n = record_nll(lm.model, records)
            agree = agreement(draft if draft is not None else lm.model, lm.model, records, pad)
            row["corpora"][name] = {"positions": n, "top1_vs_fp32_records": agree["target_matches_record"],
                                    "perplexity_of_records": math.exp(nll / max(n, 1)),
                                    "draft_agreement": agree["agreement"] if draft is not None else None}
        rows.append(row)
        print(label, json.dumps(row["corpora"]), flush=True)
    names = list(corpora)
    print("\n| model | " + " | ".join(f"{c}: top-1 = fp32 | {c}: ppl | {c}: draft agreement" for c in names) + " |")
    print("|---|" + "---|---|---|" * len(names))
    for r in rows:
        cells = []
        for c in names:
            x = r["corpora"][c]
            d = "–" if x["draft_agreement"] is None else f"{x['draft_agreement']:.3f}"
            cells += [f"{x['top1_vs_fp32_records']:.3f}", f"{x['perplexity_of_records']:.3f}", d]
        print(f"| {r['label']} | " + " | ".join(cells) + " |")
    result = {"machine": machine(), "model": a.model, "draft": a.draft, "max_records": a.max_records, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
