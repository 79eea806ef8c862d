"""Ranks agreeing on values and failing together: real gloo ranks (``engine/agreement.py``)."""

from __future__ import annotations

import pytest

from fastpersist_dist.engine.agreement import Agreement
from fastpersist_dist.tools.ranks import run_ranks

pytestmark = pytest.mark.engine

AGREEMENT = Agreement(RuntimeError, "refused", "lost")


def _sparse(rank: int, world: int, dense_above: int) -> list:
    """Ranks 1 and 3 have needs, the others none; what each rank receives."""
    value = {rank: "x" * (1000 * rank)} if rank in (1, 3) else {}
    return AGREEMENT.agree_sparse(value, dense_above=dense_above)


@pytest.mark.parametrize("dense_above", [64, 1])
def test_a_sparse_agreement_gives_every_rank_the_values_of_the_ranks_that_have_one(dense_above):
    """By broadcasts of the two values, and with ``dense_above=1`` by one gather: the same on every rank."""
    expected = [None, {1: "x" * 1000}, None, {3: "x" * 3000}]
    assert run_ranks(4, _sparse, dense_above) == [expected] * 4


def _sparse_with_a_failure(rank: int, world: int) -> str:
    try:
        if rank == 2:
            AGREEMENT.fail_together(ValueError("rank 2 could not plan"))
        AGREEMENT.agree_sparse({0: 1} if rank == 1 else {})
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "agreed"


def test_a_rank_failing_in_place_of_a_sparse_agreement_fails_every_rank_naming_it():
    outcomes = run_ranks(4, _sparse_with_a_failure)
    assert outcomes[2] == "ValueError: rank 2 could not plan", outcomes
    for r in (0, 1, 3):
        assert outcomes[r].startswith("RuntimeError: refused: group rank 2: ValueError: rank 2 could not plan"), outcomes
