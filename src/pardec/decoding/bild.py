"""`bild`: Big Little Decoder (Kim et al. 2023), a draft that falls back to the target and a target that rolls
the draft back.

Each round the draft (the "little" model) generates token by token, the argmax under greedy decoding or a sample
from its warped distribution, while it is confident: when the largest probability of its next-token
distribution falls below ``fallback_threshold``, or after ``max_draft`` tokens, control falls back to the target.
The target ("big") runs once over the drafted tokens; the first drafted token ``x_i`` whose distance to the target,
the cross-entropy ``-log p(x_i)`` of the token under the target's distribution, exceeds ``rollback_threshold`` is
rolled back with everything after it. The target then supplies the token at the first position it did not accept
(where the draft stopped, or the rolled-back position): its argmax, or a sample from its warped distribution.

``variant``:

* ``bild`` (default, the BiLD paper, Sec. 3 and its code github.com/kssteven418/BigLittleDecoder, T5BiLDModel): the
  confidence and the cross-entropy use the plain softmax (temperature 1); at a fallback the draft's unsure token is
  dropped ("the large model will produce the same token") and the target produces that position.
* ``mjsd`` (BiLD as MJSD's baseline, github.com/ZongyueQin/MJSD @ bb00dc9, BiLD_sampling in
  sampling/speculative_sampling.py): the draft's distribution and the target's are warped with the run's top-k /
  top-p at the run's temperature (1 under greedy decoding) before the confidence test and the cross-entropy (a
  token the target's top-k / top-p removes is rolled back), and the unsure token is drafted (argmax or sample) and
  kept as the round's last draft token, for the target to verify like the others.

Defaults: fallback 0.9 and rollback 2 (nats), MJSD's settings for the BiLD baseline on its ChatGPT-prompts task
(evaluation.py lines 201, 205; BiLD's README: rollback 2-5 usually works, fallback in (0, 1); its code's defaults are
0.6 and 5.0); ``max_draft`` 10 as both BiLD's code (num_small_iters) and MJSD's BiLD runs (gamma = 10).
Accepted draft tokens need not be the target's choice: ``exactness = "approximate"``.
"""

from __future__ import annotations

from typing import Literal

import torch

from pardec.config import SamplingConfig, check_choice
from pardec.decoding.base import Clock, Decoder, GenerationResult, check_range, register_method
from pardec.decoding.drafting import confidence, draft_chain
from pardec.decoding.sampling import select, warp

VARIANTS = ("bild", "mjsd")


def rollback_point(draft: torch.Tensor, logits: torch.Tensor, threshold: float,
                   warped: SamplingConfig | None = None) -> int:
    """How many of ``draft`` [m] tokens survive: the index of the first whose cross-entropy under the target,
    ``-log softmax(logits[i])[draft[i]]`` (``logits`` [m+1, V], row i scoring draft[i]; with ``warped``, of the
    distribution that config warps: infinite for a token its top-k / top-p removes), exceeds ``threshold``; ``m`` if
    none does."""
    return int(rollback_count(draft, logits, threshold, warped))


def rollback_count(draft: torch.Tensor, logits: torch.Tensor, threshold: float,
                   warped: SamplingConfig | None = None) -> torch.Tensor:
    """:func:`rollback_point` as a [1] long tensor on the logits' device (no host read)."""
    return surviving(draft[None], logits[None], threshold, warped)


def surviving(draft: torch.Tensor, logits: torch.Tensor, threshold: float, warped: SamplingConfig | None = None,
              valid: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rollback_count` of a batch of drafts: ``draft`` [n, m], ``logits`` [n, >= m, V], ``valid`` [n, m]
    (False: padding, which ends a row's surviving prefix). Returns [n] long on the logits' device."""
    n, m = draft.shape
    if m == 0:
        return torch.zeros(n, dtype=torch.long, device=logits.device)
    scored = logits[:, :m]
    logp = torch.log(warp(scored, warped)) if warped is not None else torch.log_softmax(scored.float(), -1)
    ok = -logp.gather(-1, draft.to(logits.device)[..., None])[..., 0] <= threshold
    if valid is not None:
        ok &= valid
    return ok.long().cumprod(1).sum(1)  # the surviving prefix


def check_bild(fallback_threshold: float, rollback_threshold: float, max_draft: int, variant: str) -> None:
    """``bild``'s options (batch-1 and batched), before any model loads."""
    check_range("fallback_threshold", fallback_threshold, 0.0, 1.0, integer=False)
    check_range("rollback_threshold", rollback_threshold, 0.0, 1e6, integer=False, open_lo=True)
    check_range("max_draft", max_draft, 1, 256)
    check_choice("method.variant", variant, VARIANTS)


def warping(variant: str, s: SamplingConfig) -> SamplingConfig | None:
    """The distributions the confidence and the cross-entropy are taken from: None (plain softmax) for ``bild``; the
    run's top-k / top-p at its temperature (1 under greedy decoding) for ``mjsd``."""
    if variant == "bild":
        return None
    return SamplingConfig(temperature=1.0 if s.greedy else s.temperature, top_k=s.top_k, top_p=s.top_p)


@register_method("bild")
class BigLittleDecoder(Decoder):
    exactness = "approximate"
    quality_tolerance = 0.01  # "up to 2.38x speedup with only ~1 point degradation" (arXiv 2302.07863v1, abstract)
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, fallback_threshold: float = 0.9,
                 rollback_threshold: float = 2.0, max_draft: int = 10, variant: Literal["bild", "mjsd"] = "bild"):
        super().__init__(target, tokenizer, draft)
        check_bild(fallback_threshold, rollback_threshold, max_draft, variant)
        self.fallback, self.rollback, self.max_draft = fallback_threshold, rollback_threshold, max_draft
        self.variant = variant

    def confident(self, logits: torch.Tensor, warped: SamplingConfig | None = None) -> bool:
        return float(confidence(logits, warped)) >= self.fallback

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        self.draft.reset()
        prompt = st.ids[0].tolist()
        draft_forwards = drafted = accepted = fallbacks = rollbacks = 0
        clock = Clock(st.ids.device)  # the draft's time, without a host sync per round
        warped = warping(self.variant, st.s)
        while not st.out.done:
            k = min(self.max_draft, st.out.room - 1)  # the target adds one token of its own
            toks = torch.zeros(0, dtype=torch.long, device=st.ids.device)
            if k >= 1:
                clock.start()
                chain = draft_chain(self.draft, prompt + st.out.tokens, k, st.s, st.gen,
                                    stop=lambda lg: not self.confident(lg, warped),
                                    keep_unsure=self.variant == "mjsd")
                clock.stop()
                draft_forwards += chain.forwards
                toks = chain.tokens
                fallbacks += chain.stopped
            base = self.target.length
            toks = toks.to(st.ids.device)  # drafted on the draft's device
            inp = torch.cat([torch.full((1,), last, dtype=torch.long, device=st.ids.device), toks])[None]
            logits = self.target.forward(inp).logits[0]
            st.target_forwards += 1
            # one host read: the surviving count, the draft and the target's token after every position
            m = toks.numel()
            got = torch.cat([rollback_count(toks, logits, self.rollback, warped), toks,
                             select(logits, st.s, st.gen)]).tolist()
            cut = got[0]
            rollbacks += cut < m
            acc = got[1: 1 + cut] + [got[1 + m + cut]]
            st.out.commit(acc)
            self.target.truncate(base + 1 + cut)  # `last` + the surviving draft tokens
            self.draft.confirm(acc[:cut])  # the draft's log keeps them as host values: no read-back next round
            drafted, accepted = drafted + toks.numel(), accepted + cut
            last = acc[-1]
        rounds = len(st.out.accepted) - 1  # the prefill committed the first token
        extras = {"draft_acceptance": accepted / drafted if drafted else None,
                  "fallback_rate": fallbacks / rounds if rounds else None,
                  "rollback_rate": rollbacks / rounds if rounds else None}
        return self._result(st, extras, draft_forwards, clock.seconds, drafted, accepted)
