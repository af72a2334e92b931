"""DFlash's draft model (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv
2602.06036; reference: z-lab/dflash ``dflash/model.py``; the facts and their sources: ``docs/dflash_reference.md``).

A stack of ``num_hidden_layers`` Qwen3-style decoder layers of the **target's width** that fills a whole block in
one forward:

* **context**: the target's hidden states entering ``layer_ids`` (several layers spread from shallow to deep,
  :func:`default_layers`), concatenated ``[K * H_t]``, fused by ``fc`` (linear, no bias) and ``hidden_norm``
  (RMSNorm) into one feature per context token. Every draft layer projects that feature with **its own**
  ``k_proj``/``v_proj`` (then ``k_norm`` and rotary at the token's position) into keys/values *prepended* to the
  block's own; the feature never enters the residual stream (reference ``Qwen3DFlashAttention``, "KV injection").
* **block**: ``[last verified token, mask, ..., mask]`` (``block_size`` slots at positions ``start ..
  start + B - 1``), embedded by the target's frozen embedding; the mask slots read the embedding row of
  ``mask_token_id`` (Qwen3's spare row 151669 in the published drafters) or, for a target without a spare mask
  token (SmolLM2), a learned ``mask_embedding`` vector saved with the drafter. Block queries attend to every
  context key and to **every** slot of their own block (non-causal inside the block).
* **output**: ``norm`` then the target's own LM head (shared, never stored); slot ``k`` predicts the token at
  ``start + k`` (in place), slot 0 is not predicted. With a **reduced draft vocabulary** (``draft_vocab_size``
  ids, ``speculators``' optional layout: an own ``lm_head`` [K, H] and EAGLE-3's ``d2t``/``t2d`` maps,
  :mod:`pardec.models.vocab`) the draft's logits are over those K ids (:meth:`DFlashDraft.to_target`,
  :meth:`DFlashDraft.full_logits`); :func:`restrict_vocab` gives a drafter such a head made of the target head's
  rows at a vocabulary's ids (decoding over fewer ids: the same logits at those ids, a cheaper head).

``fusion="layerwise"`` (beyond the paper: DFlare, Tan et al. 2026, arXiv 2606.02091; reference Tencent/AngelSlim
``qwen_dflare.py``): no ``fc``; draft layer ``l`` reads ``hidden_norm(sum_k softmax(layer_mix[l])_k f_k)``, its own
learned mix of the target layers' states (``layer_mix`` [N, K], zeros but 2.0 at ``[l, int(l * K / N)]``, so each
layer starts leaning on one target layer, spread shallow to deep); the target layers may be more than the draft's.
Named difference: DFlare's separate ``k_proj_target``/``v_proj_target`` for the context are not added (the context
goes through each layer's own ``k_proj``/``v_proj``, as DFlash's). Module and weight names follow the z-lab and ``speculators``
checkpoints (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
``layers.{i}.mlp.*``, ``layers.{i}.{input,post_attention}_layernorm``, ``norm``); pardec's extras are
``mask_embedding`` and ``layer_mix``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from pardec.config import ConfigError, check_choice
from pardec.models.draft_layers import SavedConfig, SwiGLU, add_projections, call
from pardec.models.drafter_types import TargetParts, only, register_drafter
from pardec.models.quant.int8 import linear_rows
from pardec.models.rotary import rope_settings, rotate
from pardec.models.vocab import DraftVocab, scatter_logits

KIND = "dflash"
FUSIONS = ("concat", "layerwise")  # concat: the paper's; layerwise: DFlare's per-layer mix
#: DFlash's defaults: 5 draft layers (the Qwen3-8B drafter, SpecForge ``configs/qwen3-8b-dflash.json``
#: ``num_hidden_layers: 5``; speculators' trainer default), block size 16 (the released ``-b16`` drafters)
DEFAULT_LAYERS, DEFAULT_BLOCK = 5, 16
KV = tuple[torch.Tensor, torch.Tensor]


def default_layers(n_layers: int, n_draft: int) -> list[int]:
    """DFlash's target layers for a target of ``n_layers`` layers and ``n_draft`` draft layers: one per draft layer,
    evenly spaced from layer 1's output to layer ``L - 3``'s (z-lab ``build_target_layer_ids``:
    ``round(1 + i * (L - 4) / (N - 1))``, ``[L // 2]`` for one draft layer), returned in pardec's convention: the
    state *entering* a layer (``CachedModel.forward(hidden_layer=...)``, transformers' ``hidden_states`` index and
    ``speculators``' ``aux_hidden_state_layer_ids``), i.e. the z-lab id plus one. Targets of fewer than 5 layers
    (tests): spread over ``0 .. L - 1``."""
    if n_draft < 1:
        raise ConfigError(f"dflash num_layers={n_draft} is out of range: it must be an integer >= 1")
    if n_layers >= 5:
        ids = [n_layers // 2] if n_draft == 1 else [round(1 + i * (n_layers - 4) / (n_draft - 1))
                                                      for i in range(n_draft)]
        return [i + 1 for i in ids]
    if n_draft == 1:
        return [n_layers // 2]
    return [round(i * (n_layers - 1) / (n_draft - 1)) for i in range(n_draft)]


@dataclass
class DFlashConfig(SavedConfig):
    """The draft's shape. :meth:`for_target` gives layers of the target's width, heads and MLP (as the published
    drafters: the Qwen3-8B draft is 5 layers of Qwen3-8B's shape)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    target_hidden_size: int
    layer_ids: list[int]  # pardec's convention: the states entering these target layers
    block_size: int = DEFAULT_BLOCK
    mask_token_id: int | None = None  # None: a learned mask_embedding
    fusion: str = "concat"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary through its own head
    extra: dict = field(default_factory=dict)  # fields of a loaded checkpoint's config pardec does not use

    def __post_init__(self) -> None:
        check_choice("dflash fusion", self.fusion, FUSIONS)
        if self.draft_vocab_size is not None and not 2 <= int(self.draft_vocab_size) <= self.vocab_size:
            raise ConfigError(f"dflash draft_vocab_size={self.draft_vocab_size} is out of range: it must be in "
                              f"[2, {self.vocab_size}] (null: the target's whole vocabulary)")
        if self.block_size < 2:
            raise ConfigError(f"dflash block_size={self.block_size} is out of range: it must be an integer >= 2 "
                              f"(the last verified token and at least one mask slot)")
        if self.mask_token_id is not None and not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ConfigError(f"dflash mask_token_id={self.mask_token_id} is out of range: the target's embedding "
                              f"has rows 0..{self.vocab_size - 1} (null: a learned mask embedding)")

    @classmethod
    def for_target(cls, target_config, num_layers: int = DEFAULT_LAYERS, layer_ids=None,
                   block_size: int = DEFAULT_BLOCK, mask_token_id: int | None = None, fusion: str = "concat",
                   ) -> DFlashConfig:
        c = target_config
        n = int(c.num_hidden_layers)
        layers = [int(i) for i in layer_ids] if layer_ids is not None else default_layers(n, int(num_layers))
        bad = [i for i in layers if not 0 <= i < n]
        if bad or not layers:
            raise ConfigError(f"dflash layers={layers} is out of range: the target's states enter layers 0..{n - 1}")
        heads = int(c.num_attention_heads)
        theta, scaling = rope_settings(c)
        return cls(hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
                   num_hidden_layers=int(num_layers), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                   vocab_size=int(c.vocab_size), target_hidden_size=int(c.hidden_size), layer_ids=layers,
                   block_size=int(block_size), mask_token_id=None if mask_token_id is None else int(mask_token_id),
                   fusion=fusion, rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=theta,
                   rope_scaling=scaling, max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)))

    def llama(self) -> LlamaConfig:
        """A Llama config of the draft's shape (its rotary tables)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, rope_parameters=rope)

    @property
    def reduced(self) -> bool:
        """Whether the draft predicts over fewer ids than the target's vocabulary (its own ``lm_head``)."""
        return self.draft_vocab_size is not None and int(self.draft_vocab_size) < self.vocab_size



class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        add_projections(self, c.hidden_size, c)
        self.q_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)  # Qwen3's per-head norms
        self.k_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lin=call) -> KV:
        """Keys (normed, rotated) and values [B, kv, T, d] of inputs ``x`` [B, T, H]."""
        b, t, _ = x.shape
        k = self.k_norm(lin(self.k_proj, x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = lin(self.v_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)


@register_drafter(KIND)
class DFlashDraft(nn.Module):
    """DFlash's draft (module docstring). :meth:`context_kv` turns target features into every layer's context
    keys/values (the caller keeps them: the decoder's context cache, a training batch's); :meth:`forward` runs
    block slots against them; :meth:`logits` applies ``norm`` and the target's head."""

    kind = KIND

    def __init__(self, config: DFlashConfig, vocab: DraftVocab | None = None):
        super().__init__()
        c = self.config = config
        n_feat = len(c.layer_ids)
        if c.fusion == "concat":
            self.fc = nn.Linear(n_feat * c.target_hidden_size, c.hidden_size, bias=False)
        elif c.target_hidden_size != c.hidden_size:
            raise ConfigError(f"dflash fusion='layerwise' mixes the target's states unprojected: the draft's width "
                              f"{c.hidden_size} must equal the target's {c.target_hidden_size}")
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        if c.fusion == "layerwise":
            mix = torch.zeros(c.num_hidden_layers, n_feat)
            for i in range(c.num_hidden_layers):
                mix[i, int(i * n_feat / c.num_hidden_layers)] = 2.0
            self.layer_mix = nn.Parameter(mix)
        self.rotary = LlamaRotaryEmbedding(config=c.llama())
        if c.reduced:  # speculators' reduced draft vocabulary: an own head over K ids and EAGLE-3's id maps
            vocab = vocab or DraftVocab(range(c.draft_vocab_size), c.vocab_size)  # (a shape-only build)
            if len(vocab) != c.draft_vocab_size or vocab.vocab_size != c.vocab_size:
                raise ConfigError(f"dflash: a draft vocabulary of {len(vocab)} of {vocab.vocab_size} ids does not fit "
                                  f"draft_vocab_size={c.draft_vocab_size} of vocab_size={c.vocab_size}")
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", vocab.d2t)
            self.register_buffer("t2d", vocab.t2d)

    # ------------------------------------------------------------------ drafter protocol (pardec.models.drafter_types)
    @property
    def k(self) -> int:
        """Proposed tokens per round at the trained block size (drafter.json's ``k``)."""
        return self.config.block_size - 1

    def meta(self) -> dict[str, Any]:
        return {"dflash": self.config.to_dict()}

    @classmethod
    def fresh(cls, base_config, target: TargetParts, options: dict[str, Any]) -> DFlashDraft:
        """:func:`new_dflash` (options ``layers`` and ``dflash``: :meth:`DFlashConfig.for_target`'s; ``vocab``: a
        reduced draft vocabulary, whose own head starts from the target head's rows); the mask embedding starts at
        the target embedding's mean row."""
        o = only(options, cls.kind, ("layers", "dflash", "vocab"))
        return new_dflash(base_config, None if target.embed is None else target.embed.weight,
                          vocab=o.get("vocab"), lm_head=None if target.lm_head is None else target.lm_head.weight,
                          **{"layer_ids": o.get("layers"), **(o.get("dflash") or {})})

    @classmethod
    def from_section(cls, base_config, options: dict[str, Any], target: TargetParts | None = None,
                     vocab: DraftVocab | None = None) -> DFlashDraft:
        """From a ``drafter`` config section (``target``: the target's parts it starts from; none: a memory plan's
        meta-device build). With ``draft_vocab_size``, ``vocab`` is its ids (training counts them:
        :func:`pardec.training.drafter.vocab.corpus_vocab`); without one the first ids stand in (a memory plan)."""
        size = options.get("draft_vocab_size")
        if size is not None and vocab is None:
            vocab = DraftVocab(range(int(size)), int(base_config.vocab_size))
        return cls.fresh(base_config, target or TargetParts(), {"layers": options.get("layers"), "vocab": vocab,
                         "dflash": {k: options[k] for k in ("num_layers", "block_size", "mask_token_id", "fusion")
                                    if k in options}})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> DFlashDraft:
        c = DFlashConfig.from_dict(meta["dflash"])
        return cls(c, DraftVocab.from_maps(state["d2t"], state.get("t2d"), c.vocab_size) if c.reduced else None)

    @property
    def vocab(self) -> DraftVocab:
        """The ids the draft predicts (the target's whole vocabulary unless :attr:`DFlashConfig.reduced`)."""
        c = self.config
        return DraftVocab.from_maps(self.d2t, self.t2d, c.vocab_size) if c.reduced else DraftVocab.full(c.vocab_size)

    # ------------------------------------------------------------------ compute
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def rotary_tables(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos/sin [B, 1, S, d] in ``like``'s dtype for ``positions`` [S] or [B, S]."""
        if positions.dim() == 1:
            positions = positions[None].expand(like.shape[0], -1)
        cos, sin = self.rotary(like, positions)
        return cos[:, None].to(like.dtype), sin[:, None].to(like.dtype)

    def fused(self, features: torch.Tensor, lin=call) -> list[torch.Tensor]:
        """[B, S, K * H_t] target features -> each draft layer's context feature [B, S, H] (the same tensor for
        every layer unless ``fusion == "layerwise"``). ``lin(module, x)`` (here and in :meth:`context_kv`,
        :meth:`forward`, :meth:`logits`): how each linear is applied (a compiled graph passes its own:
        :mod:`pardec.models.dflash_compiled`)."""
        f = features.to(self.dtype)
        if self.config.fusion == "concat":
            return [self.hidden_norm(lin(self.fc, f))] * len(self.layers)
        b, s, _ = f.shape
        states = f.view(b, s, len(self.config.layer_ids), -1)
        return [self.hidden_norm(torch.einsum("bskh,k->bsh", states, m.softmax(-1))) for m in self.layer_mix]

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor, lin=call,
                   tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[KV]:
        """Every layer's keys/values [B, kv, S, d] of context tokens with target ``features`` [B, S, K * H_t] at
        ``positions`` [S] or [B, S] (``tables``: their rotary cos/sin, computed when None)."""
        ctx = self.fused(features, lin)
        cos, sin = tables or self.rotary_tables(ctx[0], positions.to(ctx[0].device))
        return [layer.self_attn.kv(c, cos, sin, lin) for layer, c in zip(self.layers, ctx)]

    def block_inputs(self, embed: nn.Module, first: torch.Tensor, width: int) -> torch.Tensor:
        """The inputs [.., width, H] of blocks whose slot 0 holds token ids ``first`` [..] (the target's embedding
        ``embed``) and whose other slots hold the mask."""
        e0 = embed(first)
        if self.config.mask_token_id is None:
            mask = self.mask_embedding.to(e0.dtype)
        else:
            mask = embed(torch.full((), int(self.config.mask_token_id), dtype=torch.long, device=first.device))
        rest = mask.expand(*first.shape, width - 1, mask.shape[-1])
        return torch.cat([e0[..., None, :], rest.to(e0.dtype)], dim=-2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: list[KV], mask: torch.Tensor | None = None,
                lin=call, tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Block slots ``x`` [B, Q, H] at ``positions`` [Q] or [B, Q] over every layer's ``context`` keys/values
        [B, kv, S, d]; ``mask`` bool [Q, S + Q] or [B, Q, S + Q] (True: attended; or an additive float mask of that
        shape) or None (every context key and every slot); ``tables``: the positions' rotary cos/sin (computed when
        None). Returns the last layer's outputs [B, Q, H] (before ``norm``)."""
        x = x.to(self.dtype)
        b, q, _ = x.shape
        cos, sin = tables or self.rotary_tables(x, positions.to(x.device))
        if mask is not None:
            mask = (mask[None] if mask.dim() == 2 else mask)[:, None].to(x.device)
        for layer, (ck, cv) in zip(self.layers, context):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            qs = rotate(a.q_norm(lin(a.q_proj, h).view(b, q, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
            k, v = a.kv(h, cos, sin, lin)
            o = F.scaled_dot_product_attention(qs, torch.cat([ck, k], 2), torch.cat([cv, v], 2), attn_mask=mask,
                                               enable_gqa=a.heads != a.kv_heads)
            x = x + lin(a.o_proj, o.transpose(1, 2).reshape(b, q, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x), lin)
        return x

    def logits(self, out: torch.Tensor, lm_head: nn.Module, lin=call) -> torch.Tensor:
        """Logits of outputs [.., H] through ``norm`` and the target's ``lm_head`` ([.., V]), or the draft's own head
        when its vocabulary is reduced ([.., K] over draft ids: :meth:`to_target`, :meth:`full_logits`)."""
        h = self.norm(out)
        head = self.lm_head if self.config.reduced else lm_head
        w = getattr(head, "weight", None)
        if w is not None and w.is_floating_point():
            h = h.to(w.dtype)
        return lin(head, h)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of ids in :meth:`logits`' last dimension."""
        return draft_ids + self.d2t[draft_ids] if self.config.reduced else draft_ids

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`logits`' output as [.., V] target-vocabulary logits (ids the draft does not predict:
        ``finfo.min``, probability exactly 0 after a softmax)."""
        if not self.config.reduced:
            return logits
        ids = self.d2t + torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        return scatter_logits(logits, ids.to(logits.device), self.config.vocab_size)


def restrict_vocab(drafter: DFlashDraft, vocab: DraftVocab, lm_head: nn.Module) -> DFlashDraft:
    """A copy of ``drafter`` (whole-vocabulary) whose logits are over ``vocab``'s ids only, through ``lm_head``'s rows
    at those ids (:func:`~pardec.models.quant.int8.linear_rows`: each kept id's logit the whole head's, bitwise
    with pardec's int8 heads): the same drafts wherever the whole vocabulary's argmax is a kept id, for a head
    ``K / V`` as costly. The copy shares ``drafter``'s other weights."""
    c = drafter.config
    if c.reduced:
        raise ConfigError(f"dflash: the drafter already predicts over a reduced vocabulary of {c.draft_vocab_size} "
                          f"ids; a further restriction (method.draft_vocab) is not supported")
    if vocab.vocab_size != c.vocab_size:
        raise ConfigError(f"dflash: a draft vocabulary over {vocab.vocab_size} ids does not fit a drafter for a "
                          f"vocabulary of {c.vocab_size}")
    new = copy.copy(drafter)  # a new module object with registries of its own, holding the same tensors
    new.__dict__.update(_modules=dict(drafter._modules), _parameters=dict(drafter._parameters),
                        _buffers=dict(drafter._buffers))
    new.config = replace(c, draft_vocab_size=len(vocab))
    new.lm_head = linear_rows(lm_head, vocab.ids)
    new.register_buffer("d2t", vocab.d2t.to(new.lm_head.weight.device))
    new.register_buffer("t2d", vocab.t2d.to(new.lm_head.weight.device))
    return new


def new_dflash(target_config, embed: torch.Tensor | None = None, vocab: DraftVocab | None = None,
               lm_head: torch.Tensor | None = None, **options) -> DFlashDraft:
    """A fresh DFlash draft for a target with ``target_config`` (``options``: :meth:`DFlashConfig.for_target`'s);
    ``embed``: the target's embedding weight [V, H], whose mean row starts the learned mask embedding. Every norm
    starts at ones, the final ``norm`` included (the reference's ``Qwen3RMSNorm`` init). ``vocab``: a reduced draft
    vocabulary (``speculators``' layout): an own head over its ids, started from ``lm_head`` (the target's LM head
    weight [V, H]) rows at those ids, as EAGLE-3's head starts; None: the target's own head, shared."""
    config = DFlashConfig.for_target(target_config, **options)
    if vocab is not None and len(vocab) < config.vocab_size:
        config = replace(config, draft_vocab_size=len(vocab))
    draft = DFlashDraft(config, vocab if config.reduced else None)
    if config.reduced:
        vocab.start_head(draft.lm_head, lm_head)
    with torch.no_grad():
        if hasattr(draft, "mask_embedding"):
            if embed is not None and embed.is_floating_point() and embed.shape[-1] == draft.config.hidden_size:
                draft.mask_embedding.copy_(embed.detach().float().mean(0).to(draft.mask_embedding))
            else:
                draft.mask_embedding.normal_(0.0, 0.02)
    return draft


#: ``layer_init`` choices: the paper's random layers, or copies of the target's (:func:`init_from_target`)
LAYER_INITS = ("random", "target")
#: the layer-mix logit of a draft layer's own target state under :func:`init_from_target` (softmax weight
#: ``1 / (1 + (K - 1) e^-12)``: the others' share is below 1e-5 for K <= 16)
OWN_STATE_LOGIT = 12.0


@torch.no_grad()
def init_from_target(draft: DFlashDraft, base, samples: list[torch.Tensor]) -> DFlashDraft:
    """Start draft layer ``i`` as a copy of the target's layer ``layer_ids[i]`` reading the state entering it
    (``layer_init: target``, beyond the paper): with ``fusion="layerwise"``, one target layer per draft layer and the
    mix on its own state, a block slot's keys and values over the context are the target's own at that layer.

    * ``q/k/v_proj`` = the target's times its ``input_layernorm`` weight (folded: an RMSNorm's weight followed by a
      linear map is one linear map, so each layer keeps its own context norm without a per-layer norm module);
      ``input_layernorm`` and ``hidden_norm`` at ones; ``o_proj``, the MLP and ``post_attention_layernorm`` copied.
    * ``q_norm`` / ``k_norm`` (the target, Llama-style, has none): a constant, the mean per-head RMS of the target's
      queries / keys at that layer over the tokens of ``samples`` (a list of [T] token ids), so that normed
      queries and keys keep the target's scale and the attention its sharpness.
    * ``layer_mix[i]``: :data:`OWN_STATE_LOGIT` on feature ``i``, zeros elsewhere.

    Refused in one line for a target whose attention projections carry biases or whose layer shapes differ."""
    c = draft.config
    if c.fusion != "layerwise" or len(c.layer_ids) != c.num_hidden_layers:
        raise ConfigError(f"dflash layer_init='target' needs fusion='layerwise' and one target layer per draft layer "
                          f"(fusion={c.fusion!r}, {len(c.layer_ids)} target layers for {c.num_hidden_layers} draft "
                          f"layers)")
    if not samples:
        raise ValueError("init_from_target needs at least one sample sequence to calibrate the q/k norms")
    device = next(base.parameters()).device
    states = [base(ids.to(device)[None], output_hidden_states=True).hidden_states for ids in samples]
    targets = base.model.layers
    for i, (mine, j) in enumerate(zip(draft.layers, c.layer_ids)):
        theirs = targets[j]
        ta, ma = theirs.self_attn, mine.self_attn
        if any(getattr(getattr(ta, n), "bias", None) is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ConfigError(f"dflash layer_init='target' copies bias-free projections: target layer {j} has "
                              f"attention biases (use layer_init=random)")
        scale = theirs.input_layernorm.weight.float()
        pairs = [(ma.q_proj, ta.q_proj), (ma.k_proj, ta.k_proj), (ma.v_proj, ta.v_proj), (ma.o_proj, ta.o_proj),
                 (mine.mlp.gate_proj, theirs.mlp.gate_proj), (mine.mlp.up_proj, theirs.mlp.up_proj),
                 (mine.mlp.down_proj, theirs.mlp.down_proj),
                 (mine.post_attention_layernorm, theirs.post_attention_layernorm)]
        for dst, src in pairs:
            if dst.weight.shape != src.weight.shape:
                raise ConfigError(f"dflash layer_init='target': draft layer {i} does not have target layer {j}'s "
                                  f"shape ({tuple(dst.weight.shape)} vs {tuple(src.weight.shape)})")
            w = src.weight.float()
            dst.weight.copy_((w * scale if src in (ta.q_proj, ta.k_proj, ta.v_proj) else w).to(dst.weight))
        mine.input_layernorm.weight.fill_(1.0)
        for proj, norm, heads in ((ma.q_proj, ma.q_norm, ma.heads), (ma.k_proj, ma.k_norm, ma.kv_heads)):
            rms = []
            for hs in states:
                h = hs[j][0].to(proj.weight)
                x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
                rms.append(proj(x).view(x.shape[0], heads, -1).pow(2).mean(-1).sqrt().flatten())
            norm.weight.fill_(float(torch.cat(rms).mean()))
    draft.hidden_norm.weight.fill_(1.0)
    draft.layer_mix.zero_()
    draft.layer_mix[torch.arange(c.num_hidden_layers), torch.arange(c.num_hidden_layers)] = OWN_STATE_LOGIT
    return draft
