"""``firp`` over a batch: the loop of :mod:`pardec.decoding.batch.medusa` (a candidate tree per row, verified and
compacted together), each row's next drafts from K pseudo states born from its last accepted node, as batch-1
``firp`` makes them (:mod:`pardec.decoding.heads`, FIRP §3.3).

The target's forward over the trees captures the hidden states entering the projections' layers; after every row's
cache is compacted to its accepted path, pseudo state ``i`` of each row is born entering layer ``layers[i]`` from its
accepted path's last node (the row's last cached position, the anchor), at the anchor's position + i + 1, and runs
through the layers above in one pass for every row, seeing the row's cache (what the anchor sees in batch-1's forward:
its prefix and itself) and, with ``attention=pseudo`` (the paper's inference, "No masked"), the row's earlier pseudo
states, with ``attention=real`` itself only; their keys are never cached. Batch-1 makes every node's pseudo states in
its verification forward and keeps the accepted node's; here only the accepted node's are made, after the
verification, in a second pass through the upper layers (the same states, computed over another layout of the same
keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pardec.config import check_choice
from pardec.decoding.batch.engine import register_batched
from pardec.decoding.batch.medusa import BatchedTreeDrafter
from pardec.models.forward import lean
from pardec.models.masks import additive_mask
from pardec.models.pseudo import DECODING_ATTENTION, PSEUDO_ATTENTION


@register_batched("firp")
class BatchedFirp(BatchedTreeDrafter):
    """``path``, ``tree``, ``k``, ``attention``, ``int8_weights``: as batch-1 ``firp``'s."""

    kind = "firp"

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, tree: str = "chain",
                 k: int | None = None, attention: str = DECODING_ATTENTION, int8_weights: str | None = None):
        check_choice("method.attention", attention, PSEUDO_ATTENTION)
        super().__init__(target, tokenizer, draft, path, tree, k, int8_weights)
        self.layers = [int(x) for x in self.drafter.layers[: self.k]]
        self.births = tuple(sorted(set(self.layers)))
        own = torch.arange(self.k, device=target.device)
        # pseudo state i sees pseudo state i' of its row: i' <= i ("pseudo"), or itself only ("real"); on the device
        # every round's mask is built on
        self.sees = own[None, :] <= own[:, None] if attention == "pseudo" else own[None, :] == own[:, None]

    @property
    def capture(self) -> tuple[int, ...]:
        return self.births

    def _drafts(self, first: int, hidden: torch.Tensor) -> torch.Tensor:
        model, n, k = self.target.model, hidden.shape[0], self.k
        inner, dev = model.model, hidden.device
        born_from = hidden.view(n, len(self.births), -1)  # [n, layers, H]: each row's anchor entering each layer
        views, mask, lens = self.target.past(first, n, k, dev, self.sees)  # mask [n, k, S + k]
        s = mask.shape[-1] - k
        positions = lens[:, None] + torch.arange(k, device=dev)  # the anchor sits at length - 1
        cos, sin = inner.rotary_emb(born_from, position_ids=positions)
        cos, sin = cos[:, None], sin[:, None]
        h = born_from.new_zeros(n, 0, born_from.shape[-1])
        born = 0
        for layer in range(self.layers[0], len(inner.layers)):
            while born < k and self.layers[born] == layer:
                new = self.drafter(born, born_from[:, self.births.index(layer)][:, None])
                h = torch.cat([h, new.to(h.dtype)], 1)
                born += 1
            m = h.shape[1]
            past = views[layer] if views is not None else None
            see = additive_mask(mask[:, :m, : s + m], h.dtype)

            def attend(a, q, kk, vv, past=past, see=see):
                if past is not None:
                    kk, vv = torch.cat([past[0].to(q.dtype), kk], 2), torch.cat([past[1].to(q.dtype), vv], 2)
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=see, scale=a.scaling,
                                                      enable_gqa=q.shape[1] != kk.shape[1])

            h = lean.decoder_layer(inner.layers[layer], h, cos[:, :, :m], sin[:, :, :m], attend)
        return lean.head(model, h)  # [n, k, V]: the final norm, then the LM head
