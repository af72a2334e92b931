"""A draft's reduced vocabulary: the target ids a drafter's head predicts, and the maps between the two id spaces.

* :func:`choose_vocab`: ``size`` target ids from token counts of the target's own completions (the ids that must
  stay first, then the most frequent; EAGLE-3 §3.3 / its ``scandata``: the corpus's most frequent tokens);
* :class:`DraftVocab`: the sorted kept ids and EAGLE-3's two maps, in the layout its checkpoints store (the
  original release and vLLM's ``speculators`` format alike):

  - ``d2t`` [K] long, an **offset** per draft id: target id = ``d + d2t[d]``;
  - ``t2d`` [V] bool: whether a target id is in the draft vocabulary.

  Draft logits [.., K] map to target ids by :meth:`DraftVocab.to_target` (a top-k's indices) or
  :meth:`DraftVocab.full_logits` (scattered into [.., V], every other id ``finfo.min``: probability exactly 0 after
  a softmax); the target's logits restrict to the kept ids by ``target_logits[..., vocab.ids]`` (training targets).

pardec's distilled draft model (:mod:`pardec.models.draft`) and the EAGLE-3 / DFlash drafters share these;
:func:`read_vocab` reads a kept drafter's maps (a DFlash drafter decoded over another drafter's vocabulary).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from pardec.config import ConfigError

#: the weight files a drafter directory keeps its maps in (pardec's, then speculators' / EAGLE-3's)
MAP_FILES = ("drafter.safetensors", "model.safetensors")


def choose_vocab(token_counts: Counter | dict[int, int], size: int, always: Iterable[int], vocab_size: int) -> list[int]:
    """``size`` ids: ``always`` (EOS, specials), then the most counted ids (ties: lower id first), then the lowest
    unused ids (BPE ids roughly follow merge frequency); sorted. ``vocab_size``: the target's V."""
    if not 2 <= size <= vocab_size:
        raise ValueError(f"draft vocab size {size} is out of range: it must be in [2, {vocab_size}]")
    keep = list(dict.fromkeys(int(i) for i in always if 0 <= int(i) < vocab_size))
    if len(keep) > size:
        raise ValueError(f"draft vocab size {size} is smaller than the {len(keep)} ids that must be kept")
    chosen = set(keep)
    for tok, _ in sorted(token_counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if 0 <= tok < vocab_size:
            chosen.add(int(tok))
    fill = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < size:
        chosen.add(next(fill))
    return sorted(chosen)


def scatter_logits(draft_logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., K] logits of the kept ``ids`` [K] -> [..., V]: every other id ``finfo(dtype).min`` (finite on purpose:
    pardec treats NaN/inf logits as an error; after a softmax those ids have probability exactly 0 in fp32)."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), torch.finfo(draft_logits.dtype).min)
    return full.scatter(-1, ids.expand_as(draft_logits), draft_logits)


class DraftVocab:
    """The kept target ids ``ids`` (sorted, unique) of a target vocabulary of ``vocab_size`` ids."""

    def __init__(self, ids: Iterable[int], vocab_size: int):
        ids = [int(i) for i in ids]
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"a draft vocabulary must be sorted unique ids in [0, {vocab_size}); got {len(ids)} ids"
                             + (f" from {ids[0]} to {ids[-1]}" if ids else ""))
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.vocab_size = vocab_size

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        """Every target id (no reduction: ``d2t`` all zeros)."""
        return cls(range(vocab_size), vocab_size)

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor | None = None, vocab_size: int | None = None
                  ) -> DraftVocab:
        """From EAGLE-3's stored maps (``t2d`` only checked, and only its length needed when ``vocab_size`` is
        None); a mismatch between them raises naming both."""
        ids = (torch.arange(d2t.numel()) + d2t.detach().cpu().long()).tolist()
        size = vocab_size if vocab_size is not None else (int(t2d.numel()) if t2d is not None else ids[-1] + 1)
        vocab = cls(ids, size)
        if t2d is not None:
            if t2d.numel() != size:
                raise ValueError(f"t2d has {t2d.numel()} entries; the target vocabulary has {size}")
            if not torch.equal(t2d.detach().cpu().bool(), vocab.t2d):
                raise ValueError("d2t and t2d disagree: the ids d + d2t[d] are not the ids t2d marks")
        return vocab

    def __len__(self) -> int:
        return int(self.ids.numel())

    @property
    def reduced(self) -> bool:
        return len(self) < self.vocab_size

    @property
    def d2t(self) -> torch.Tensor:
        """[K] long offsets: target id = draft id + d2t[draft id]."""
        return self.ids - torch.arange(len(self))

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: the target ids in the draft vocabulary."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.ids] = True
        return m

    @torch.no_grad()
    def start_head(self, head: torch.nn.Linear, weight: torch.Tensor | None) -> None:
        """Start a draft's own ``head`` [K, H] as the rows at the kept ids of a target head ``weight`` [V, H] (as
        EAGLE-3's training loads the target's head); left as it is when there is no ``weight`` of that width."""
        if weight is not None and weight.shape[1] == head.weight.shape[1]:
            head.weight.copy_(weight.detach()[self.ids.to(weight.device)].to(head.weight))

    def to_target(self, draft_ids: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
        """Target ids of draft ids (any shape); ``d2t``: the offsets already on ``draft_ids``' device (a drafter's
        buffer), else this vocabulary's are moved there."""
        d2t = d2t if d2t is not None else self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def full_logits(self, draft_logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] -> [..., V]: the kept ids get the draft's logits, every other id ``finfo(dtype).min``."""
        if not self.reduced:
            return draft_logits
        return scatter_logits(draft_logits, ids if ids is not None else self.ids.to(draft_logits.device),
                              self.vocab_size)


def read_vocab(path: str | Path, key: str, vocab_size: int | None = None) -> DraftVocab:
    """The draft vocabulary a drafter directory keeps (``d2t``, with ``t2d`` when present, in ``drafter.safetensors``
    or ``model.safetensors``: an EAGLE-3 drafter, pardec's or speculators'); ``vocab_size``: the target's, checked
    when given. Anything else is one line naming ``key``, the directory and what it lacks."""
    d = Path(path)
    f = next((d / n for n in MAP_FILES if (d / n).is_file()), None)
    if f is None:
        raise ConfigError(f"{key}={str(path)!r} holds no drafter weights ({' or '.join(MAP_FILES)}): name a drafter "
                          f"with a draft vocabulary (an EAGLE-3 drafter, e.g. zoo:eagle3)")
    try:
        with safe_open(str(f), framework="pt") as st:
            names = set(st.keys())
            if "d2t" not in names:
                raise ConfigError(f"{key}={str(path)!r}: {f.name} has no draft vocabulary (no d2t map): name a drafter "
                                  f"with one (an EAGLE-3 drafter, e.g. zoo:eagle3)")
            d2t = st.get_tensor("d2t")
            t2d = st.get_tensor("t2d") if "t2d" in names else None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file: one line)
        raise ConfigError(f"{key}={str(path)!r}: cannot read {f.name} ({type(e).__name__})") from None
    try:
        vocab = DraftVocab.from_maps(d2t, t2d, vocab_size)
    except ValueError as e:
        raise ConfigError(f"{key}={str(path)!r}: {e}") from None
    return vocab
