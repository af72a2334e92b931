"""Fast-forward and stationary token counts on hand-made trajectories."""

from pardec.decoding.jacobi import stationary_count


def test_stationary_token_counted_once():
    fp = [1, 2, 3, 4]
    # state 0: pos 2 right (3) behind a wrong pos 1 (9) and never changes afterwards -> stationary
    states = [[1, 9, 3, 8], [1, 2, 3, 8], [1, 2, 3, 4]]
    committed = [0, 2, 4]
    assert stationary_count(states, committed, fp) == 1


def test_token_that_changes_later_is_not_stationary():
    fp = [1, 2, 3, 4]
    states = [[1, 9, 3, 8], [1, 2, 5, 8], [1, 2, 3, 4]]  # pos 2 right, then wrong, then right again
    committed = [0, 2, 4]
    assert stationary_count(states, committed, fp) == 0


def test_correct_prefix_is_fast_forward_not_stationary():
    fp = [1, 2, 3, 4]
    states = [[1, 2, 3, 9], [1, 2, 3, 4]]  # right tokens with no wrong token before them
    committed = [0, 4]
    assert stationary_count(states, committed, fp) == 0


def test_several_stationary_tokens():
    fp = [5, 6, 7, 8, 9]
    states = [[0, 0, 7, 8, 0], [5, 6, 7, 8, 0], [5, 6, 7, 8, 9]]
    committed = [0, 2, 5]
    assert stationary_count(states, committed, fp) == 2


# ------------------------------------------------------------------------------------------- initial guesses
def test_initial_guess_draws_from_prompt_and_output():
    """CLLM Algorithm 3: the guess draws uniformly from the prompt *and* the output so far. One randint of n
    indices into the pool; torch.randint(5, (8,)) under seed 0 gives [4, 4, 3, 0, 3, 4, 2, 3] and
    torch.randint(3, (8,)) gives [2, 0, 2, 0, 1, 0, 1, 1]."""
    import torch

    from pardec.decoding.jacobi import initial_guess

    prompt, output = [10, 11, 12], [20, 21]
    got = initial_guess(prompt, output, 8, torch.Generator().manual_seed(0))  # pool [10, 11, 12, 20, 21]
    assert got == [21, 21, 20, 10, 20, 21, 12, 20]  # output tokens 20 and 21 are drawn
    got = initial_guess(prompt, output, 8, torch.Generator().manual_seed(0), "prompt")  # pool [10, 11, 12]
    assert got == [12, 10, 12, 10, 11, 10, 11, 11]


def test_jacobi_guesses_see_the_output_and_stay_exact():
    import pytest

    from pardec.config import ConfigError
    from pardec.decoding import Stopper, build_decoder
    from pardec.decoding.jacobi import Jacobi
    from pardec.models.cached import CachedModel
    from tests.conftest import tiny

    calls = []

    class Spy(Jacobi):
        def initial_guess(self, prompt, output, n, gen):
            guess = super().initial_guess(prompt, output, n, gen)
            calls.append((list(prompt), list(output), guess))
            return guess

    lm = tiny(1)
    cm = CachedModel(lm.model)
    ids = [1, 504, 1812]
    ar = build_decoder("ar", cm, None).generate(ids, 24, Stopper()).tokens
    with pytest.raises(ConfigError, match=r"method.guess_from='output' is not valid; choose one of: context, prompt"):
        Jacobi(cm, guess_from="output")
    for guess_from in ("context", "prompt"):
        calls.clear()
        res = Spy(cm, block_size=4, guess_from=guess_from).generate(ids, 24, Stopper())
        assert res.tokens == ar  # the guess changes only the speed
        assert len(calls) >= 6
        for prompt, output, guess in calls:
            assert prompt == ids and output == ar[: len(output)]  # the output committed before the block
            pool = prompt + output if guess_from == "context" else prompt
            assert set(guess) <= set(pool)
        drawn = {t for _, output, guess in calls for t in guess}
        assert bool(drawn - set(ids)) == (guess_from == "context")
