"""`sps`: speculative sampling with a draft model (Leviathan et al. 2023; Chen et al. 2023).

Each round the draft proposes ``gamma`` tokens autoregressively with its own KV cache (first resynchronised
with the committed sequence: :meth:`CachedModel.sync` keeps the common prefix and feeds the rest), then one
target forward over ``[last committed, d_1..d_gamma]`` verifies them (:func:`verify_chain` with the draft's
distributions ``q``): greedy output equals greedy ``ar`` token for token, sampled output follows the target's
distribution exactly (``exactness = "distribution"``). The draft samples from its own warped distribution
(the run's temperature / top-k / top-p) and under greedy decoding proposes its argmax.

``adaptive=true`` changes gamma between rounds: +1 after a fully accepted draft (up to ``gamma_max``), -1 when
fewer than half of the draft was accepted (down to ``gamma_min``); ``gamma`` is the starting value.

``gamma_by_cost=true`` instead picks each round's gamma from measured costs (Leviathan et al. 2023 §3.5: the
gamma that maximises the expected tokens per unit of time, ``(1 - a^(g+1)) / (1 - a)`` tokens for a target forward
of g + 1 rows plus g draft forwards). The target's cost of g + 1 rows comes from this machine's forward-cost table
(``python -m pardec.bench cost``; padded to the cheapest measured row count >= g + 1, as the verification forward
is), the draft's cost per forward from its own clock in this run (from the second round on: the first one
runs the prompt through the draft), and the acceptance rate ``a`` from this
generation's rounds (accepted / (accepted + rejections), with one of each as a prior). The first two rounds
use ``gamma``. Exactness is untouched: only the draft's length changes.

``confidence_threshold`` (beyond the paper, whose draft always proposes gamma tokens; transformers' assisted
generation's ``assistant_confidence_threshold``, 0.4 there): a round's draft ends at the first token the draft gives
less than this probability (the largest of its plain softmax), that token still drafted, so a draft that is unsure
spends neither its own forwards nor the target's rows on the tokens after it; 0 (the default): off. The test reads
the draft's logits on the host once per drafted token. It depends on the draft alone, so exactness is untouched.
"""

from __future__ import annotations

import torch

from pardec.config import ConfigError, check_at_least
from pardec.decoding.base import Decoder, DraftClock, GenerationResult, check_range, register_method
from pardec.decoding.drafting import confidence, draft_chain
from pardec.models.cost import best_draft_length


@register_method("sps", aliases=("speculative", "speculative_sampling"))
class SpeculativeSampling(Decoder):
    exactness = "distribution"
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4, adaptive: bool = False,
                 gamma_min: int = 1, gamma_max: int = 12, gamma_by_cost: bool = False,
                 confidence_threshold: float = 0.0):
        super().__init__(target, tokenizer, draft)
        check_range("confidence_threshold", confidence_threshold, 0.0, 1.0, integer=False)
        self.confidence_threshold = confidence_threshold
        for key, v in (("gamma", gamma), ("gamma_min", gamma_min), ("gamma_max", gamma_max)):
            check_at_least(f"method.{key}", v, 1, integer=True)
        if adaptive and gamma_by_cost:
            raise ConfigError("method.adaptive=true and method.gamma_by_cost=true both choose gamma: pick one")
        if (adaptive or gamma_by_cost) and not gamma_min <= gamma <= gamma_max:
            which = "adaptive" if adaptive else "gamma_by_cost"
            raise ConfigError(f"method.gamma={gamma} must lie in [gamma_min, gamma_max] = [{gamma_min}, {gamma_max}] "
                              f"when method.{which}=true")
        self.gamma, self.adaptive, self.gamma_min, self.gamma_max = gamma, adaptive, gamma_min, gamma_max
        self.gamma_by_cost = gamma_by_cost

    def gamma_for(self, accepted: int, rejections: int, draft_ms: float, room: int) -> int:
        """The gamma in [gamma_min, min(gamma_max, room)] with the most expected tokens per ms (module doc)."""
        return best_draft_length(self.target.cost, accepted, rejections, draft_ms, self.gamma_min,
                                 min(self.gamma_max, room))

    def propose(self, seq: list[int], k: int, st) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Draft ``k`` tokens after ``seq`` (prompt + committed). Returns (tokens [k], q [k, V] or None under
        greedy, draft forwards)."""
        unsure = None
        if self.confidence_threshold > 0:
            def unsure(logits: torch.Tensor) -> bool:
                return float(confidence(logits)) < self.confidence_threshold
        chain = draft_chain(self.draft, seq, k, st.s, st.gen, stop=unsure, keep_unsure=True)
        return chain.tokens, chain.q, chain.forwards

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        if self.gamma_by_cost and self.target.cost is None:
            raise ConfigError("method.gamma_by_cost=true needs this machine's forward-cost table for the target, and "
                              "there is none: run python -m pardec.bench cost (and keep forward_padding=true)")
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        self.draft.reset()
        prompt = st.ids[0].tolist()
        gamma = self.gamma
        drafted = accepted = rejections = 0
        clock = DraftClock()
        since: tuple[float, int] | None = None
        gammas: list[int] = []
        while not st.out.done:
            k = min(gamma, st.out.room - 1)  # the target adds one token of its own
            if k < 1:
                last = self._step_alone(st, last)
                continue
            toks, q, _ = clock.run(st, self.propose, prompt + st.out.tokens, k, st)
            k = len(toks)  # fewer when the draft was unsure (confidence_threshold)
            _, acc, _ = self._verify_chain(st, last, toks, q)
            n_acc = len(acc) - 1
            self.draft.confirm(acc[:n_acc])  # the draft's log keeps them as host values: no read-back next round
            drafted, accepted = drafted + k, accepted + n_acc
            rejections += n_acc < k
            gammas.append(k)
            if self.gamma_by_cost:  # the draft's ms per forward from the second round on (the first one ran the prompt)
                if since is None:
                    since = (clock.seconds, clock.forwards)
                elif clock.forwards > since[1]:
                    draft_ms = (clock.seconds - since[0]) * 1e3 / (clock.forwards - since[1])
                    gamma = self.gamma_for(accepted, rejections, draft_ms, st.out.room - 1)
            elif self.adaptive:
                if n_acc == k:
                    gamma = min(self.gamma_max, gamma + 1)
                elif 2 * n_acc < k:
                    gamma = max(self.gamma_min, gamma - 1)
            last = acc[-1]
        extras = {"draft_acceptance": accepted / drafted if drafted else None,
                  "mean_gamma": sum(gammas) / len(gammas) if gammas else None}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, accepted)
