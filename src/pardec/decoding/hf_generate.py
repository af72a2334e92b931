"""transformers' own ``generate()`` as reference peers, with our settings and our stop rule:

* ``hf_generate``: plain greedy / sampled ``generate()`` (the baseline next to ``ar``);
* ``hf_pld``: its prompt lookup decoding (``prompt_lookup_num_tokens``);
* ``hf_assisted``: its assisted generation with our draft model object (``assistant_model=``).

Nothing leaks in from the model's own ``generation_config`` (its EOS ids, ``top_k=50``, repetition penalty...):
generate() fills every unset field from it, so for the duration of a call the model (and the draft) get a blank
one and every setting that matters is passed explicitly. Counts are real: forward hooks on the target (and draft)
modules count their forwards, the tokens each forward verifies and the draft's wall time, and a stopping criterion
sees what each target forward committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from pardec.config import ConfigError, SamplingConfig, check_at_least
from pardec.decoding.base import Clock, Decoder, GenerationResult, Output, Stopper, Timer, register_method
from pardec.models.cached import CachedModel, NonFiniteLogitsError


@register_method("hf_generate")
class HFGenerate(Decoder):
    exactness = "tokens"

    def _extra_config(self) -> dict:
        """GenerationConfig fields of this variant (prompt lookup, assistant)."""
        return {}

    def _assistant(self) -> CachedModel | None:
        return None

    def _assistant_config(self) -> GenerationConfig:
        return GenerationConfig()

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        s = sampling or SamplingConfig()
        stop = stop or Stopper()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(self.target.device)
        model = self.target.model
        eos = sorted(stop.eos_ids) or None  # None: no EOS stop, like our decoders with an empty Stopper
        gc = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not s.greedy,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else model.config.pad_token_id,
            # explicit when sampling, also when off: an unset field is filled in (top_k=None becomes 50)
            temperature=None if s.greedy else s.temperature,
            top_k=None if s.greedy else s.top_k,
            top_p=None if s.greedy else s.top_p,
            **self._extra_config(),
        )
        if not s.greedy:
            torch.manual_seed(s.seed)
        assistant = self._assistant()
        chunks = _Chunks(stop, ids.shape[1])
        target_hooks = _Hooks(model, f"target model {self.target.name!r}")
        with contextlib.ExitStack() as stack:
            stack.enter_context(_blank_generation_config(model, GenerationConfig()))
            stack.enter_context(target_hooks)
            draft_hooks = None
            if assistant is not None:
                stack.enter_context(_blank_generation_config(assistant.model, self._assistant_config()))
                draft_hooks = stack.enter_context(_Hooks(assistant.model, f"draft model {assistant.name!r}",
                                                         timed=True))
            timer = Timer(ids.device)
            target_hooks.start()
            try:
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                     stopping_criteria=StoppingCriteriaList([chunks]),
                                     **({"assistant_model": assistant.model} if assistant is not None else {}))
            except RuntimeError:  # e.g. sampling from NaN probabilities: name the cause when it is NaN/inf logits
                for hooks in (target_hooks, draft_hooks):
                    if hooks is not None:
                        hooks.check()
                raise
            total = timer.elapsed()
        target_hooks.check()
        if draft_hooks is not None:
            draft_hooks.check()
        new = seq[0, ids.shape[1] :].tolist()
        # our own stop rule over what each target forward committed, so every method is cut the same way
        out = Output(max_new_tokens, stop)
        at = 0
        for n in chunks.sizes:
            if out.done:
                break
            out.commit(new[at : at + n])
            at += n
        # the first target forward verifies prompt + draft, each later one [last token, *draft]
        sizes = target_hooks.sizes
        drafted = (sizes[0] - ids.shape[1] if sizes else 0) + sum(k - 1 for k in sizes[1:])
        return GenerationResult(
            out.tokens, out.reason or "length", target_hooks.calls,
            draft_forwards=draft_hooks.calls if draft_hooks else 0, accepted=out.accepted,
            prefill_s=target_hooks.first_s, total_s=total, draft_s=draft_hooks.seconds if draft_hooks else 0.0,
            drafted=drafted, draft_accepted=sum(n - 1 for n in chunks.sizes),
        )


@register_method("hf_pld", aliases=("hf_prompt_lookup",))
class HFPromptLookup(HFGenerate):
    """generate(prompt_lookup_num_tokens=...): transformers' prompt lookup decoding (its defaults: 10, 2)."""

    exactness = "tokens"

    def __init__(self, target, tokenizer=None, draft=None, prompt_lookup_num_tokens: int = 10,
                 max_matching_ngram_size: int = 2):
        super().__init__(target, tokenizer, draft)
        for key, v in (("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
                       ("max_matching_ngram_size", max_matching_ngram_size)):
            check_at_least(f"method.{key}", v, 1)
        self.num_tokens, self.ngram = prompt_lookup_num_tokens, max_matching_ngram_size

    def _extra_config(self) -> dict:
        return {"prompt_lookup_num_tokens": self.num_tokens, "max_matching_ngram_size": self.ngram}


SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@register_method("hf_assisted", aliases=("hf_assisted_generation",))
class HFAssisted(HFGenerate):
    """generate(assistant_model=draft): transformers' assisted generation with the run's draft model object.

    The draft settings, which generate() reads from the draft's own ``generation_config``, are set per call
    (and the draft's config restored afterwards). Defaults are transformers 5.23's: ``num_assistant_tokens=20``,
    ``num_assistant_tokens_schedule="constant"`` (``heuristic``: +2 after a fully accepted draft, -1 otherwise),
    ``assistant_confidence_threshold=0.4`` (the draft stops early when its top probability falls below it; 0
    disables it).
    """

    exactness = "tokens"
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, num_assistant_tokens: int = 20,
                 num_assistant_tokens_schedule: str = "constant", assistant_confidence_threshold: float = 0.4):
        super().__init__(target, tokenizer, draft)
        check_at_least("method.num_assistant_tokens", num_assistant_tokens, 1)
        if num_assistant_tokens_schedule not in SCHEDULES:
            raise ConfigError(f"method.num_assistant_tokens_schedule={num_assistant_tokens_schedule!r} is not valid; "
                              f"choose one of: {', '.join(SCHEDULES)}")
        if not 0.0 <= assistant_confidence_threshold < 1.0:
            raise ConfigError(f"method.assistant_confidence_threshold={assistant_confidence_threshold!r} is out of "
                              f"range: it must be in [0, 1)")
        self.num_tokens, self.schedule = num_assistant_tokens, num_assistant_tokens_schedule
        self.threshold = assistant_confidence_threshold

    def _assistant(self) -> CachedModel | None:
        return self.draft

    def _assistant_config(self) -> GenerationConfig:
        return GenerationConfig(num_assistant_tokens=self.num_tokens, num_assistant_tokens_schedule=self.schedule,
                                assistant_confidence_threshold=self.threshold)


@contextlib.contextmanager
def _blank_generation_config(model: torch.nn.Module, gc: GenerationConfig) -> Iterator[None]:
    """Give ``model`` the generation config ``gc`` for the duration of the block, then restore its own."""
    saved = model.generation_config
    model.generation_config = gc
    try:
        yield
    finally:
        model.generation_config = saved


class _Hooks:
    """Forward hooks on one HF module for one generate() call: forwards, input tokens per forward, time to the
    end of the first forward, optionally wall time inside forwards (:class:`Clock`: CUDA events, no host sync);
    NaN/inf logits raise :class:`NonFiniteLogitsError` naming the model and the position, checked by
    :meth:`check` after the call (each forward leaves a flag on the device: no sync inside the timed region)."""

    def __init__(self, module: torch.nn.Module, name: str, timed: bool = False):
        self.module, self.name, self.timed = module, name, timed
        self.calls = 0
        self.sizes: list[int] = []  # input tokens of each forward
        self.clock = Clock(module.device)  # inside forwards (timed only)
        self.first = Clock(module.device)  # from start() to the end of the first forward
        self._finite: list[tuple[torch.Tensor, int]] = []  # per forward: finite rows [T] (device), cache end
        self._handles: list = []

    def __enter__(self) -> _Hooks:
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def start(self) -> None:
        self.first.start()

    @property
    def seconds(self) -> float:
        return self.clock.seconds

    @property
    def first_s(self) -> float:
        return self.first.seconds

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sizes.append(int(ids.shape[1]) if ids is not None else 0)
        if self.timed:
            self.clock.start()

    def _post(self, module, args, kwargs, output) -> None:
        self.calls += 1
        if self.timed:
            self.clock.stop()
        if self.calls == 1 and self.first._start is not None:
            self.first.stop()
        logits = output.logits  # [1, T, V]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # (the name before transformers 5.24)
        end = cache.get_seq_length() if cache is not None else logits.shape[1]
        self._finite.append((torch.isfinite(logits).all(-1)[0], end))

    def check(self) -> None:
        """Raise :class:`NonFiniteLogitsError` at the first forward whose logits held NaN/inf (one host sync)."""
        if not self._finite:
            return
        flags = torch.stack([f.all() for f, _ in self._finite]).cpu()
        for i in (~flags).nonzero().flatten().tolist()[:1]:
            finite, end = self._finite[i]
            pos = end - finite.shape[0] + int((~finite).nonzero()[0])
            raise NonFiniteLogitsError(f"{self.name} produced NaN/inf logits at sequence position {pos} "
                                       f"(forward {i + 1})")


class _Chunks(StoppingCriteria):
    """generate() stopping criterion, called once per target forward: records how many tokens that forward
    committed and applies :class:`Stopper` (EOS ids and stop strings) to them, on the generated tokens only
    (generate()'s own stop strings also match across the prompt boundary and would stop elsewhere)."""

    def __init__(self, stop: Stopper, prompt_len: int):
        self.stop, self.prompt_len = stop, prompt_len
        self.sizes: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        seq = input_ids[0, self.prompt_len :].tolist()
        done = self.prompt_len + sum(self.sizes)
        n = input_ids.shape[1] - done
        self.sizes.append(n)
        prev, new = seq[: len(seq) - n], seq[len(seq) - n :]
        hit = self.stop.first_stop(prev, new) is not None
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)
