"""A real megatron-core GPTModel (built on CPU) saved with FastPersist and loaded into a fresh model."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from .helpers import assert_same, load, save
from .multiproc import run_ranks


def build_model(tp: int, seed: int) -> GPTModel:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tp,
    )
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32)


def _save_model(rank: int, world: int, path: str, strategy: Optional[object] = None) -> None:
    save(build_model(world, seed=1).sharded_state_dict(), path, strategy=strategy)


def _load_model(rank: int, world: int, path: str, loader: Optional[Callable[[], object]] = None) -> int:
    """Load into a differently initialized model; ``loader``: makes the load strategy (default: none, a plain load)."""
    model = build_model(world, seed=2)
    reference = build_model(world, seed=1).state_dict()
    assert any(not torch.equal(v, reference[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))
    loaded = load(model.sharded_state_dict(), path, **({"sharded_strategy": loader()} if loader else {}))
    model.load_state_dict(loaded)
    checked = 0
    for k, v in model.state_dict().items():
        if torch.is_tensor(v) and not k.endswith("_extra_state"):
            assert_same(v, reference[k], k)
            checked += 1
    return checked


def test_gpt_model_round_trip_and_tp_reshard(tmp_path):
    path = str(tmp_path / "gpt")
    run_ranks(2, _save_model, path)
    assert min(run_ranks(2, _load_model, path)) > 20  # same TP=2
    assert run_ranks(1, _load_model, path)[0] > 20  # TP=2 checkpoint into a TP=1 model
