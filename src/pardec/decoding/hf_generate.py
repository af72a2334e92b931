"""`hf_generate`: transformers' own ``generate()`` with the same settings, as a reference baseline."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from pardec.config import SamplingConfig
from pardec.decoding.base import Decoder, GenerationResult, Output, Stopper, Timer, register_method


@register_method("hf_generate", aliases=("hf",))
class HFGenerate(Decoder):
    lossless = True

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        s = sampling or SamplingConfig()
        stop = stop or Stopper()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(self.target.device)
        model = self.target.model
        eos = sorted(stop.eos_ids) or None  # None: no EOS stop, like our decoders with an empty Stopper
        # a fresh config (not the model's, whose eos/sampling defaults would leak in)
        gc = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not s.greedy,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else model.config.pad_token_id,
            temperature=s.temperature if not s.greedy else None,
            top_k=(s.top_k or None) if not s.greedy else None,
            top_p=s.top_p if not s.greedy else None,
        )
        if not s.greedy:
            torch.manual_seed(s.seed)
        # our stop-string rule (generated text only), not generate()'s own, which also matches across the
        # prompt boundary and would stop at a different token
        criteria = StoppingCriteriaList([_StopStrings(stop, ids.shape[1])]) if stop.stop_strings else None
        timer = Timer(ids.device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                             stopping_criteria=criteria)
        total = timer.elapsed()
        new = seq[0, ids.shape[1] :].tolist()
        # apply our own stop rule to generate()'s output so every method is cut the same way
        out = Output(max_new_tokens, stop)
        out.commit(new)
        n = len(out.tokens)
        return GenerationResult(out.tokens, out.reason or "length", n, 0, [1] * n, 0.0, total)


class _StopStrings(StoppingCriteria):
    """generate() stopping criterion applying :class:`Stopper`'s stop strings to the generated tokens."""

    def __init__(self, stop: Stopper, prompt_len: int):
        self.stop, self.prompt_len = stop, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[0, self.prompt_len :].tolist()
        hit = self.stop.first_stop(new[:-1], new[-1:]) if new else None
        return torch.full((input_ids.shape[0],), hit is not None, dtype=torch.bool, device=input_ids.device)
