"""EAGLE-3's exporter (``python -m pardec.export <drafter> --format eagle3|speculators``; the layouts:
:mod:`pardec.models.eagle_formats`): the original release's layout (``eagle3``) and vLLM ``speculators``'."""

from __future__ import annotations

import json

import torch

from pardec.config import ConfigError
from pardec.models.drafter_types import Exporter, register_exporter
from pardec.models.eagle import Eagle3Config, Eagle3Draft
from pardec.models.eagle_formats import (
    eagle3_config_json,
    external_state,
    speculators_config_json,
    target_embedding,
)
from pardec.models.vocab import DraftVocab


@register_exporter("eagle3")
class Eagle3Exporter(Exporter):
    formats = ("eagle3", "speculators")

    def config(self, meta: dict, state: dict):
        config = Eagle3Config.from_dict(meta["eagle3"])
        DraftVocab.from_maps(state["d2t"], state["t2d"], config.vocab_size)  # raises when they disagree
        with torch.device("meta"):  # shapes only: nothing allocated
            stand_in = DraftVocab(range(config.draft_vocab_size), config.vocab_size)
            shapes = {k: tuple(v.shape) for k, v in Eagle3Draft(config, stand_in).state_dict().items()}
        return config, shapes

    def write(self, meta, state, config, fmt, *, verifier, architectures, speculative_tokens, with_embeddings,
              notes):
        n = 3 if speculative_tokens is None else speculative_tokens
        dtype = state["lm_head.weight"].dtype
        if len(config.layer_ids) != 3:
            notes.append(f"the drafter fuses {len(config.layer_ids)} target layers; vLLM's and SGLang's EAGLE-3 "
                         f"drafts fuse exactly 3")
        if config.norm_before_residual and fmt == "eagle3":
            notes.append("the drafter uses norm_before_residual, which vLLM reads but SGLang's and the original "
                         "release's EAGLE-3 layers ignore: serve it with vLLM")
        weights = external_state(state, fmt, config.draft_vocab_size < config.vocab_size)
        if with_embeddings is not None:
            emb = target_embedding(with_embeddings)
            want = (config.vocab_size, config.hidden_size)
            if tuple(emb.shape) != want:
                raise ConfigError(f"--with-embeddings={str(with_embeddings)!r}: its embedding is {tuple(emb.shape)}; "
                                  f"the drafter needs {want} (vocab_size, hidden_size)")
            weights["embed_tokens.weight"] = emb.to(dtype).contiguous()
        cfg_json = (eagle3_config_json(config, dtype) if fmt == "eagle3"
                    else speculators_config_json(config, dtype, n, verifier, architectures))
        return weights, cfg_json, n

    def describe(self, config) -> str:
        return f"draft vocabulary {config.draft_vocab_size} of {config.vocab_size}, feature layers {config.layer_ids}"

    def serve(self, out, target: str, fmt: str, n: int) -> list[str]:
        vllm = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": n})
        sglang = " (its eagle3 loader names the layer midlayer.*: prefer --format eagle3)" if fmt == "speculators" else ""
        return [f"serve with vLLM:\n  vllm serve {target} --speculative-config '{vllm}'",
                f"serve with SGLang{sglang}:\n  python -m sglang.launch_server --model-path {target} "
                f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out} --speculative-num-steps {n} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {n + 1}"]
