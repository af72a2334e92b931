"""`ar`: plain autoregressive decoding with a KV cache, one target forward per token (the baseline)."""

from __future__ import annotations

import torch

from pardec.decoding.base import Decoder, GenerationResult, register_method
from pardec.decoding.sampling import select


@register_method("ar", aliases=("greedy", "autoregressive"))
class AR(Decoder):
    exactness = "distribution"

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        tok = torch.tensor([[last]], device=st.ids.device)
        while not st.out.done:
            logits = self.target.forward(tok).logits[:, -1]
            st.target_forwards += 1
            tok = select(logits, st.s, st.gen)[:, None]
            st.out.commit([int(tok)])
        return self._result(st)
