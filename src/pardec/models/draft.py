"""A draft model cut from its target: a few of the target's decoder layers and a head over a reduced vocabulary.

:class:`DraftForCausalLM` is a ``LlamaForCausalLM`` whose ``lm_head`` maps the hidden state to the K kept token
ids only (``config.draft_vocab``, sorted). Its forward still returns logits over the FULL vocabulary [B, T, V],
so every consumer (pardec's ``sps``, transformers' ``generate`` and assisted generation) sees an ordinary causal
LM sharing the target's tokenizer: the head's K outputs are scattered into the kept ids and every other id gets
``torch.finfo(dtype).min`` (finite on purpose: pardec treats NaN/inf logits as an error; after softmax those ids
have probability exactly 0 in fp32). ``forward(..., draft_logits=True)`` returns the K head outputs instead
[B, T, K] (training: no full-vocabulary tensor).

Importing :mod:`pardec.models` registers the class with ``AutoConfig`` / ``AutoModelForCausalLM`` (model type
``pardec_draft``), so ``AutoModelForCausalLM.from_pretrained(dir)`` and ``model=local`` load a saved draft.

:func:`build_draft` copies the target's embeddings, chosen layers (re-indexed 0..k-1 for the KV cache), final
norm and the head rows of the kept ids; :func:`pardec.models.vocab.choose_vocab` picks the kept ids from token
counts.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from pardec.models.compat import cache_kw, output_cache, output_cache_field
from pardec.models.vocab import scatter_logits

MODEL_TYPE = "pardec_draft"


@strict
class DraftConfig(LlamaConfig):
    """A Llama config plus ``draft_vocab``: the token ids the draft head predicts (sorted, unique)."""

    model_type = MODEL_TYPE
    draft_vocab: list[int] | None = None  # None: the whole vocabulary

    def __post_init__(self, **kwargs):
        if self.draft_vocab is None:
            self.draft_vocab = list(range(self.vocab_size))
        v = list(self.draft_vocab)
        if v != sorted(set(v)) or not v or v[0] < 0 or v[-1] >= self.vocab_size:
            raise ValueError(f"draft_vocab must be sorted unique ids in [0, {self.vocab_size}); got {len(v)} ids")
        self.tie_word_embeddings = False  # the embeddings (V rows) and the head (K rows) differ
        super().__post_init__(**kwargs)


class DraftForCausalLM(LlamaForCausalLM):
    config_class = DraftConfig
    _tied_weights_keys = {}

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, len(config.draft_vocab), bias=False)
        self._vocab_ids: torch.Tensor | None = None  # [K] kept ids (not a buffer: from_pretrained skips those)
        self.post_init()

    def vocab_ids(self, device: torch.device) -> torch.Tensor:
        """[K] the kept token ids, on ``device``."""
        if self._vocab_ids is None or self._vocab_ids.device != device:
            self._vocab_ids = torch.tensor(self.config.draft_vocab, dtype=torch.long, device=device)
        return self._vocab_ids

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0, draft_logits: bool = False,
                past_key_values=None, **kwargs) -> CausalLMOutputWithPast:
        """As ``LlamaForCausalLM.forward``; logits [B, T, V] (``draft_logits``: the head's [B, T, K]). The KV cache
        comes as ``cache`` (transformers 5.24+) or ``past_key_values`` (earlier releases, and callers that still use
        it): see :mod:`pardec.models.compat`."""
        if labels is not None:
            raise ValueError("DraftForCausalLM computes no loss: pass labels=None (train with DistillTrainer)")
        if cache is not None and past_key_values is not None:
            raise ValueError("DraftForCausalLM.forward: pass the KV cache as `cache` or `past_key_values`, not both")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **cache_kw(self.model, cache if cache is not None else past_key_values),
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        h = slice_logits_to_keep(out.last_hidden_state, logits_to_keep)  # [B, T', H]
        logits = self.lm_head(h)  # [B, T', K]
        if not draft_logits:
            logits = self.full_logits(logits)
        return CausalLMOutputWithPast(logits=logits, hidden_states=out.hidden_states, attentions=out.attentions,
                                      **{output_cache_field(CausalLMOutputWithPast): output_cache(out)})

    def full_logits(self, head_logits: torch.Tensor) -> torch.Tensor:
        """[..., K] head outputs -> [..., V]: kept ids get them, every other id ``finfo(dtype).min``."""
        return scatter_logits(head_logits, self.vocab_ids(head_logits.device), self.config.vocab_size)


def _register() -> None:
    try:
        AutoConfig.register(MODEL_TYPE, DraftConfig)
        AutoModelForCausalLM.register(DraftConfig, DraftForCausalLM)
    except ValueError:  # already registered (module reloaded)
        pass


_register()


# ------------------------------------------------------------------------------------------- building
@torch.no_grad()
def build_draft(target: LlamaForCausalLM, layers: list[int], vocab_ids: list[int]) -> DraftForCausalLM:
    """A :class:`DraftForCausalLM` holding copies of the target's embeddings, ``layers`` (in this order, re-indexed
    0..k-1), final norm and the head rows of ``vocab_ids``; same dtype and device as the target."""
    tcfg = target.config
    n = tcfg.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"draft layers {list(layers)} are out of range: the target has layers 0..{n - 1}")
    keys = {k: v for k, v in tcfg.to_dict().items() if k in LlamaConfig.__dataclass_fields__}
    keys.update(num_hidden_layers=len(layers), draft_vocab=sorted(set(int(i) for i in vocab_ids)),
                tie_word_embeddings=False, architectures=["DraftForCausalLM"])
    cfg = DraftConfig(**keys)
    cfg._attn_implementation = tcfg._attn_implementation
    p = next(target.parameters())
    draft = DraftForCausalLM(cfg).to(device=p.device, dtype=p.dtype)
    draft.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    for j, i in enumerate(layers):
        src = target.model.layers[i].state_dict()
        draft.model.layers[j].load_state_dict(src)
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    head = target.get_output_embeddings().weight  # [V, H] (tied: the embedding matrix)
    ids = torch.tensor(cfg.draft_vocab, device=head.device)
    draft.lm_head.weight.copy_(head[ids])  # [K, H]
    draft.generation_config = type(target.generation_config).from_dict(target.generation_config.to_dict())
    return draft.eval()
