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
