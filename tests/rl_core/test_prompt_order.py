"""Dataset prompt order (``rl_core.rollout.prompt_order``): a seeded shuffle per epoch, and a
resumed run that continues its epoch instead of starting the order again."""

from __future__ import annotations

import collections
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.rollout import prompt_order


def take(iterator, n: int) -> list[int]:
    return list(itertools.islice(iterator, n))


def test_each_epoch_is_a_permutation_and_the_seed_fixes_the_order():
    order = take(prompt_order(7, seed=3), 21)
    for epoch in range(3):
        assert sorted(order[epoch * 7 : (epoch + 1) * 7]) == list(range(7))
    assert order == take(prompt_order(7, seed=3), 21)
    assert order != take(prompt_order(7, seed=4), 21)
    assert order[:7] != order[7:14]  # reshuffled each epoch


def test_a_resumed_run_continues_its_epoch_where_it_stopped():
    full = take(prompt_order(10, seed=1), 30)
    used = collections.Counter(full[:4])
    assert take(prompt_order(10, seed=1, used=used), 26) == full[4:]


def test_a_group_lost_in_flight_is_generated_again_before_the_epoch_ends():
    full = take(prompt_order(10, seed=1), 20)
    # The first 6 groups were started; the 3rd was in flight when the job died (never submitted).
    used = collections.Counter(full[:2] + full[3:6])
    resumed = take(prompt_order(10, seed=1, used=used), 5)
    assert resumed == [full[2], *full[6:10]]
    epoch = list(used.elements()) + resumed
    assert sorted(epoch) == list(range(10))  # no prompt twice, none left out


@settings(max_examples=80, deadline=None)
@given(
    n_rows=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    started=st.integers(0, 40),
    lost=st.sets(st.integers(1, 4), max_size=4),
)
def test_the_resumed_epoch_ends_with_every_row_used_once_more(n_rows, seed, started, lost):
    """Groups in flight at the crash (among the last 4 started) are lost; the rest were
    submitted. The resumed order completes the epoch: each row then used equally often."""
    full = take(prompt_order(n_rows, seed), started)
    submitted = [index for i, index in enumerate(full) if started - i not in lost]
    epoch_end = -(-started // n_rows) * n_rows  # the end of the epoch the crash fell in
    resumed = take(prompt_order(n_rows, seed, collections.Counter(submitted)), epoch_end)
    done = collections.Counter(submitted + resumed[: epoch_end - len(submitted)])
    assert done == {index: epoch_end // n_rows for index in range(n_rows)} or epoch_end == 0
