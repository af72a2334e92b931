"""`jacobi`: Jacobi decoding with a KV cache (CLLM paper, Algorithm 3).

An n-token block is initialised with tokens drawn uniformly at random, with replacement, from the context: the
prompt and the output so far (``guess_from="context"``, the default: CLLM Algorithm 3 and the official code,
hao-ai-lab/Consistency_LLM eval/gsm8k/speedup.py ``jacobi_generate`` and data/generate_trajectory.py, which draw
from the whole sequence so far); ``guess_from="prompt"`` draws from the prompt only (pardec's earlier choice). The
guess only changes how fast a block converges, never what it converges to.

Each iteration runs one target forward over ``[last committed token, guess_0 .. guess_{r-2}]`` (r = tokens of the
block still open), which yields a new guess for all r positions at once. The longest prefix of the old guess that
the forward confirms, plus the first new token (always correct), is committed ("fast-forwarded"); the cache keeps
only the committed positions and the rest of the new guess is iterated on. Under greedy decoding the committed
tokens are exactly greedy AR's; under sampling the guess is verified by rejection sampling (``verify_chain``).

Reported per generation (``extras``):

* ``fast_forward``: mean tokens committed per Jacobi iteration (the CLLM paper's fast-forwarded count;
  plain Jacobi on an AR model gives ~1.0-1.1, a CLLM 2-3);
* ``stationary_tokens``: tokens that were already correct in a state while an earlier open position was
  still wrong, and stayed unchanged until committed (the paper's stationary tokens), summed over blocks;
  ``stationary_per_block``: their mean over the complete blocks (the paper's Table 3 counts per block);
* ``trajectories``: per block, every state from the initial guess to the fixed point (n tokens each), the
  committed length after each iteration, and the fixed point.
"""

from __future__ import annotations

import torch

from pardec.config import ConfigError, check_at_least, check_choice
from pardec.decoding.base import Decoder, GenerationResult, register_method
from pardec.decoding.sampling import select

#: where a Jacobi block's initial guess draws its tokens from: the prompt and the output so far (CLLM Alg. 3), or the
#: prompt alone
GUESS_FROM = ("context", "prompt")


def check_guess_from(value: str, key: str = "method.guess_from") -> None:
    check_choice(key, value, GUESS_FROM)


def initial_guess(prompt: list[int], output: list[int], n: int, gen: torch.Generator,
                  guess_from: str = "context") -> list[int]:
    """``n`` tokens drawn uniformly with replacement from ``prompt + output`` (``guess_from="context"``, CLLM
    Algorithm 3) or from ``prompt`` alone (``"prompt"``), with ``gen``: one ``torch.randint`` of ``n`` indices into
    that pool. Shared by the ``jacobi`` decoder and the CLLM trajectory collection."""
    pool = list(prompt) + list(output) if guess_from == "context" else list(prompt)
    return [pool[i] for i in torch.randint(len(pool), (n,), generator=gen).tolist()]


def stationary_count(states: list[list[int]], committed: list[int], fixed_point: list[int]) -> int:
    """Tokens of one block that were right while preceded by a wrong open token, and stayed so.

    states[t]: the block after t iterations (states[0] = initial guess); committed[t]: how many of its
    leading tokens were committed by then; fixed_point: the converged block.
    """
    count = 0
    n = len(fixed_point)
    for j in range(n):
        # first state from which position j never changes again (and equals the fixed point)
        t_j = len(states)
        for t in range(len(states) - 1, -1, -1):
            if j >= len(states[t]) or states[t][j] != fixed_point[j]:
                break
            t_j = t
        for t in range(t_j, len(states)):
            if committed[t] > j:
                break
            if any(states[t][i] != fixed_point[i] for i in range(committed[t], j)):
                count += 1
                break
    return count


@register_method("jacobi")
class Jacobi(Decoder):
    exactness = "distribution"

    def __init__(self, target, tokenizer=None, draft=None, block_size: int = 16, max_iters: int | None = None,
                 record_trajectories: bool = True, guess_from: str = "context"):
        super().__init__(target, tokenizer, draft)
        check_guess_from(guess_from)
        check_at_least("method.block_size", block_size, 1)
        if max_iters is not None and max_iters < 1:
            raise ConfigError(f"method.max_iters={max_iters} is out of range: it must be >= 1 (or null)")
        self.block_size = block_size
        # every iteration commits >= 1 token, so n iterations always finish a block; a lower cap ends a
        # block early (its open tokens are dropped, a new block starts: still lossless)
        self.max_iters = max_iters or block_size
        self.record_trajectories = record_trajectories
        self.guess_from = guess_from

    def initial_guess(self, prompt: list[int], output: list[int], n: int, gen: torch.Generator) -> list[int]:
        """n random tokens of the context (:func:`initial_guess`). Tests override it to steer acceptance."""
        return initial_guess(prompt, output, n, gen, self.guess_from)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        out = st.out
        init_gen = torch.Generator().manual_seed(st.s.seed)  # initial guesses, seeded independently
        prompt = st.ids[0].tolist()
        ff_counts: list[int] = []
        trajectories: list[dict] = []
        stationary = complete_blocks = 0
        while not out.done:
            n = min(self.block_size, out.room)
            guess = self.initial_guess(prompt, out.tokens, n, init_gen)
            block: list[int] = []  # committed tokens of this block
            states, committed = [list(guess)], [0]
            while len(block) < n and not out.done and len(states) <= self.max_iters:  # iterations = len - 1
                # the guess's last token has no successor in the block: it is only predicted, not verified
                # the next guesses (the target's token after every position; those past the accepted ones are
                # kept) come back in the verification's one host read
                _, acc, kept = self._verify_chain(st, last, torch.tensor(guess[:-1], dtype=torch.long),
                                                  extra=lambda lg: select(lg, st.s, st.gen))
                block += kept
                ff_counts.append(len(kept))
                last = acc[-1]
                guess = st.extra[len(acc):] if len(block) < n else []
                states.append(block + guess)
                committed.append(len(block))
            complete = len(block) == n
            if complete:
                stationary += stationary_count(states, committed, block)
                complete_blocks += 1
            if self.record_trajectories:
                trajectories.append({"states": states, "committed": committed, "fixed_point": block,
                                     "complete": complete})
        extras = {
            "fast_forward": sum(ff_counts) / max(1, len(ff_counts)),
            "stationary_tokens": stationary,
            "stationary_per_block": stationary / complete_blocks if complete_blocks else None,
            "jacobi_iterations": len(ff_counts),
            "blocks": len(trajectories) if self.record_trajectories else None,
        }
        if self.record_trajectories:
            extras["trajectories"] = trajectories
        return self._result(st, extras)
