"""DFlash's exporter (``python -m pardec.export <drafter> --format dflash|speculators``; the layouts:
:mod:`pardec.models.dflash_formats`): the z-lab release layout (``dflash``) and ``speculators``' ``dflash``."""

from __future__ import annotations

import json

import torch

from pardec.config import ConfigError
from pardec.models.dflash import DFlashConfig, DFlashDraft
from pardec.models.dflash_formats import speculators_config_json, zlab_config_json
from pardec.models.drafter_types import Exporter, register_exporter


@register_exporter("dflash")
class DFlashExporter(Exporter):
    formats = ("dflash", "speculators")

    def config(self, meta: dict, state: dict):
        config = DFlashConfig.from_dict(meta["dflash"])
        with torch.device("meta"):  # shapes only: nothing allocated
            shapes = {k: tuple(v.shape) for k, v in DFlashDraft(config).state_dict().items()}
        return config, shapes

    def write(self, meta, state, config, fmt, *, verifier, architectures, speculative_tokens, with_embeddings,
              notes):
        n = config.block_size - 1 if speculative_tokens is None else speculative_tokens
        if n > config.block_size - 1:
            raise ConfigError(f"--speculative-tokens={n} is out of range: a block of {config.block_size} proposes at "
                              f"most {config.block_size - 1}")
        if with_embeddings is not None:
            raise ConfigError("--with-embeddings applies to EAGLE-3 only: DFlash's drafts always share the target's "
                              "embedding (the published layouts store none)")
        dtype = state["norm.weight"].dtype
        if config.mask_token_id is None:
            notes.append("the drafter's mask slot is a learned embedding (mask_embedding, written with the weights; "
                         "mask_token_id null): pardec loads it back, but vLLM and SGLang embed a mask token id from "
                         "the target's table and do not read it; to serve, train with drafter.mask_token_id=<a spare "
                         "row>")
        if config.fusion == "layerwise":
            notes.append("the drafter uses DFlare's layer-wise fusion (layer_mix, no fc): pardec loads it back, but "
                         "vLLM's and SGLang's DFlash drafts fuse with fc and do not read it")
        if fmt == "dflash" and config.reduced:
            raise ConfigError(f"the drafter predicts over a reduced draft vocabulary ({config.draft_vocab_size} of "
                              f"{config.vocab_size} ids, its own lm_head): the z-lab layout has none; export "
                              f"--format speculators")
        if fmt == "dflash":
            cfg_json = zlab_config_json(config, dtype, int(meta["num_hidden_layers"]))
        else:
            cfg_json = speculators_config_json(config, dtype, verifier, architectures)
            cfg_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = n
        return {k: v.detach().contiguous() for k, v in state.items()}, cfg_json, n

    def describe(self, config) -> str:
        return f"{config.num_hidden_layers} layers, block {config.block_size}, target layers {config.layer_ids}"

    def serve(self, out, target: str, fmt: str, n: int) -> list[str]:
        vllm = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": n})
        return [f"serve with vLLM:\n  vllm serve {target} --speculative-config '{vllm}'",
                f"serve with SGLang:\n  python -m sglang.launch_server --model-path {target} --speculative-algorithm "
                f"DFLASH --speculative-draft-model-path {out} --speculative-num-draft-tokens {n + 1}"]
