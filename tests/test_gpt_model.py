"""A real megatron-core GPTModel (built on CPU) saved with FastPersist and loaded into a fresh model."""

from __future__ import annotations

import pytest

from fastpersist_dist.tools.ranks import run_ranks

from .states import load_model, save_model

pytestmark = pytest.mark.contract


def test_gpt_model_round_trip_and_tp_reshard(tmp_path):
    path = str(tmp_path / "gpt")
    run_ranks(2, save_model, path)
    assert min(run_ranks(2, load_model, path)) > 20  # same TP=2
    assert run_ranks(1, load_model, path)[0] > 20  # TP=2 checkpoint into a TP=1 model
