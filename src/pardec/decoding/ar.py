"""`ar`: plain autoregressive decoding with a KV cache, one target forward per token (the baseline)."""

from __future__ import annotations

import torch

from pardec.config import SamplingConfig
from pardec.decoding.base import Decoder, GenerationResult, Output, Stopper, Timer, register_method
from pardec.decoding.sampling import make_generator, select


@register_method("ar", aliases=("greedy", "autoregressive"))
class AR(Decoder):
    lossless = True

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        s = sampling or SamplingConfig()
        out = Output(max_new_tokens, stop or Stopper())
        ids = self._prompt(prompt_ids)
        gen = make_generator(s, ids.device)
        timer = Timer(ids.device)
        tok = select(self.target.prefill(ids), s, gen)  # [1]
        out.commit([int(tok)])
        prefill_s = timer.elapsed()
        forwards = 1
        while not out.done:
            logits = self.target.forward(tok[:, None]).logits[:, -1]
            forwards += 1
            tok = select(logits, s, gen)
            out.commit([int(tok)])
        return GenerationResult(out.tokens, out.reason, forwards, 0, out.accepted, prefill_s, timer.elapsed())
