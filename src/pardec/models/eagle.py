"""EAGLE-3's draft model (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", §3; reference: SafeAILab/EAGLE ``eagle/model/cnets.py`` and ``eagle/traineagle3/cnets.py``).

One decoder layer that reads, at position ``j``,

* the target's hidden states entering layers ``layer_ids`` (low, middle, high: EAGLE-3's ``2, L // 2, L - 3``,
  :func:`default_layers`), concatenated ``[3 * H_t]`` and fused by ``fc`` (a linear layer, no bias) to ``[H]``;
  at later draft steps the draft's *own* output at the parent position replaces the fused features (training-time
  test trains it to);
* the target's embedding of the token at ``j + 1`` (the embedding is the target's, frozen, never stored here).

The layer: ``x = [input_layernorm(emb), hidden_norm(h)]`` ``[2H]`` -> attention with q/k/v projections from ``2H``
(rotary at the entry's position) -> ``h + o_proj(...)`` -> ``+ mlp(post_attention_layernorm(.))``. Its output
``o_j`` goes through ``norm`` and ``lm_head`` over the **draft vocabulary** (``draft_vocab_size`` ids, mapped to
target ids by the ``d2t`` offsets, :mod:`pardec.models.vocab`) and is the next step's ``h``.

Module and buffer names are vLLM's ``speculators`` layout (``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``); the original release names the layer ``midlayer.*`` (:mod:`pardec.models.eagle_formats` reads and writes
both). ``norm_before_residual`` (a ``speculators`` option, off in the original): the residual is the normed hidden
state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from pardec.config import ConfigError
from pardec.models.draft_layers import SavedConfig, SwiGLU, add_projections
from pardec.models.drafter_types import TargetParts, only, register_drafter
from pardec.models.rotary import rope_settings, rotate
from pardec.models.vocab import DraftVocab, scatter_logits

KIND = "eagle3"


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high feature layers for a target of ``n_layers`` layers: the states entering layers 2,
    L // 2 and L - 3 (reference ``modeling_llama_kv.py``: ``idx == 2 or idx == L // 2 or idx == L - 3``; vLLM's
    ``eagle_aux_hidden_state_layer_ids`` default). Targets of fewer than 6 layers (tests): 0, L // 2, L - 1."""
    if n_layers >= 6:
        return (2, n_layers // 2, n_layers - 3)
    return (0, n_layers // 2, max(0, n_layers - 1))


@dataclass
class Eagle3Config(SavedConfig):
    """The draft's shape. :meth:`for_target` mirrors the target's layer (EAGLE-3's drafters are one target-width
    Llama layer with the target's head counts and MLP width)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict)  # fields of a loaded checkpoint's config pardec does not use

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None, layer_ids=None) -> Eagle3Config:
        c = target_config
        n = int(c.num_hidden_layers)
        layers = list(layer_ids) if layer_ids is not None else list(default_layers(n))
        bad = [i for i in layers if not 0 <= int(i) < n]
        if bad or not layers:
            raise ConfigError(f"eagle3 layers={layers} is out of range: the target has layers 0..{n - 1}")
        vocab = int(c.vocab_size)
        size = vocab if draft_vocab_size is None else int(draft_vocab_size)
        if not 2 <= size <= vocab:
            raise ConfigError(f"eagle3 draft_vocab_size={size} is out of range: it must be in [2, {vocab}]")
        heads = int(c.num_attention_heads)
        theta, scaling = rope_settings(c)
        return cls(hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
                   num_attention_heads=heads, num_key_value_heads=int(getattr(c, "num_key_value_heads", heads)),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads), vocab_size=vocab,
                   draft_vocab_size=size, target_hidden_size=int(c.hidden_size), layer_ids=[int(i) for i in layers],
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
                   rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)))

    def llama(self) -> LlamaConfig:
        """The one-layer Llama config of the draft layer (rotary tables; the export's ``transformer_layer_config``)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, rope_parameters=rope,
                           tie_word_embeddings=False)



class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        add_projections(self, 2 * c.hidden_size, c)


class _Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)


KV = tuple[torch.Tensor, torch.Tensor]


@register_drafter(KIND)
class Eagle3Draft(nn.Module):
    """EAGLE-3's draft (module docstring). ``forward`` runs new entries after ``past`` (their keys/values, which the
    caller keeps: the decoder's draft cache, training-time test's steps); ``logits`` maps outputs to draft-vocabulary
    logits; ``vocab`` holds the id maps."""

    kind = KIND

    def __init__(self, config: Eagle3Config, vocab: DraftVocab | None = None):
        super().__init__()
        c = self.config = config
        vocab = vocab or DraftVocab.full(c.vocab_size)
        if len(vocab) != c.draft_vocab_size or vocab.vocab_size != c.vocab_size:
            raise ConfigError(f"eagle3: a draft vocabulary of {len(vocab)} of {vocab.vocab_size} ids does not fit "
                              f"draft_vocab_size={c.draft_vocab_size} of vocab_size={c.vocab_size}")
        self.fc = nn.Linear(len(c.layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(c)])
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", vocab.d2t)
        self.register_buffer("t2d", vocab.t2d)
        self.rotary = LlamaRotaryEmbedding(config=c.llama())

    # ------------------------------------------------------------------ drafter protocol (pardec.models.heads)
    @property
    def dtype(self) -> torch.dtype:
        """The float dtype it computes in (its final norm's: the linears may be int8, ``pardec.models.drafters.place``)."""
        return self.norm.weight.dtype

    @property
    def k(self) -> int:
        """Fused target layers (drafter.json's ``k``; the draft's depth is a decoding setting)."""
        return len(self.config.layer_ids)

    def meta(self) -> dict[str, Any]:
        return {"eagle3": self.config.to_dict()}

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab.from_maps(self.d2t, self.t2d, self.config.vocab_size)

    @classmethod
    def fresh(cls, base_config, target: TargetParts, options: dict[str, Any]) -> Eagle3Draft:
        """:func:`new_eagle3` (options ``layers``, ``vocab``); the head starts from the target's LM head rows."""
        o = only(options, cls.kind, ("layers", "vocab"))
        return new_eagle3(base_config, o.get("vocab"), o.get("layers"),
                          None if target.lm_head is None else target.lm_head.weight)

    @classmethod
    def from_section(cls, base_config, options: dict[str, Any], target: TargetParts | None = None) -> Eagle3Draft:
        """From a ``drafter`` config section (no corpus: the draft vocabulary's first ``draft_vocab_size`` ids stand in
        for the counted ones; a memory plan's meta-device build). Training counts its vocabulary first
        (:func:`pardec.training.drafter.vocab.corpus_vocab`) and calls :meth:`fresh`."""
        size = int(options.get("draft_vocab_size", base_config.vocab_size))
        return cls.fresh(base_config, target or TargetParts(), {"layers": options.get("layers"),
                                                      "vocab": DraftVocab(range(size), int(base_config.vocab_size))})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> Eagle3Draft:
        """Shaped by drafter.json's ``eagle3`` config; its draft vocabulary from the saved id maps."""
        return cls(Eagle3Config.from_dict(meta["eagle3"]),
                   DraftVocab.from_maps(state["d2t"], state["t2d"], int(base_config.vocab_size)))

    # ------------------------------------------------------------------ compute
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[.., n * H_t] target features (``CachedModel.forward(hidden_layer=layer_ids)``) -> [.., H]."""
        return self.fc(features.to(self.dtype))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past: KV | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """New entries: ``emb`` [B, T, H] (the target's embeddings of their tokens), ``hidden`` [B, T, H] (fused
        target features or the draft's outputs), ``positions`` [B, T] or [T]. ``past``: keys/values [B, kv, S, d]
        of earlier entries; ``mask``: bool [T, S + T] / [B, T, S + T] (True: attended) or None (causal over
        ``past`` and the new entries). Returns (outputs [B, T, H], the new entries' keys/values)."""
        layer = self.layers[0]
        a = layer.self_attn
        dtype = self.dtype
        emb, hidden = emb.to(dtype), hidden.to(dtype)
        bsz, t, _ = hidden.shape
        if positions.dim() == 1:
            positions = positions[None].expand(bsz, t)
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        q = a.q_proj(x).view(bsz, t, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(bsz, t, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(bsz, t, a.kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        s = keys.shape[2] - t
        if mask is None:
            mask = torch.ones(t, s + t, dtype=torch.bool, device=q.device).tril(s)
        if mask.dim() == 2:
            mask = mask[None]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None].to(q.device),
                                           enable_gqa=a.heads != a.kv_heads)
        h = residual + a.o_proj(o.transpose(1, 2).reshape(bsz, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., K] of outputs [.., H]."""
        return self.lm_head(self.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """[K] the target id of every draft-vocabulary id, on the drafter's device (no host read)."""
        return self.to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[.., K] -> [.., V] (ids outside the draft vocabulary ``finfo.min``)."""
        if self.config.draft_vocab_size == self.config.vocab_size:
            return draft_logits
        return scatter_logits(draft_logits, self.target_ids().to(draft_logits.device), self.config.vocab_size)


def new_eagle3(target_config, vocab: DraftVocab | None = None, layer_ids=None, lm_head: torch.Tensor | None = None,
               ) -> Eagle3Draft:
    """A fresh EAGLE-3 draft for a target with ``target_config``; ``lm_head``: the target's LM head weight [V, H],
    whose rows of the kept ids initialise the draft's head (as EAGLE-3's training loads the target's head)."""
    vocab = vocab or DraftVocab.full(int(target_config.vocab_size))
    draft = Eagle3Draft(Eagle3Config.for_target(target_config, len(vocab), layer_ids), vocab)
    vocab.start_head(draft.lm_head, lm_head)
    return draft
