"""A GPT-shaped sharded state dict (model + Adam states) of a chosen size, for benchmarks.

Shapes follow Megatron's GPT: per layer fused QKV and fc1 split on axis 0
across tensor-parallel ranks, proj and fc2 split on axis 1, layer norms
replicated; a vocab-parallel embedding. Each parameter comes with bf16 model
weights and fp32 main weights, exp_avg and exp_avg_sq, as a distributed
optimizer's state dict would. Data-parallel replicas carry replica_id = dp rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing import ShardedTensor

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight + fp32 main weight, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class GptShape:
    """Global parameter shapes of a GPT with ``layers`` layers of width ``hidden``."""

    hidden: int
    layers: int
    vocab: int

    @classmethod
    def for_bytes(cls, total_bytes: int, tp: int, layers: int = 4) -> "GptShape":
        """The widest model (hidden a multiple of 64 * tp) whose state fits ``total_bytes``."""
        # params ~= layers * 12 h^2 + vocab * h, vocab = 8 h
        per_h2 = layers * 12 + 8
        hidden = int(math.sqrt(total_bytes / BYTES_PER_PARAM / per_h2))
        step = 64 * tp
        return cls(hidden=max(step, hidden // step * step), layers=layers, vocab=8 * max(step, hidden // step * step))

    def params(self) -> dict[str, tuple[tuple[int, ...], object]]:
        """name -> (global shape, tensor-parallel split axis or None)."""
        h, out = self.hidden, {"embedding.word_embeddings.weight": ((self.vocab, self.hidden), 0)}
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            out[p + "input_layernorm.weight"] = ((h,), None)
            out[p + "self_attention.linear_qkv.weight"] = ((3 * h, h), 0)
            out[p + "self_attention.linear_proj.weight"] = ((h, h), 1)
            out[p + "pre_mlp_layernorm.weight"] = ((h,), None)
            out[p + "mlp.linear_fc1.weight"] = ((4 * h, h), 0)
            out[p + "mlp.linear_fc2.weight"] = ((h, 4 * h), 1)
        out["decoder.final_layernorm.weight"] = ((h,), None)
        return out

    def total_bytes(self) -> int:
        """Bytes of the whole (unsharded, unreplicated) state."""
        return sum(math.prod(s) for s, _ in self.params().values()) * BYTES_PER_PARAM


def gpt_sharded_state_dict(
    shape: GptShape, tp: int, rank: int, world: int, transpose: bool = False, device: torch.device = torch.device("cpu")
) -> dict:
    """This rank's sharded state dict on ``device``: TP over consecutive ranks, DP over the rest.

    Values are a function of the global element index, so any sharding of the
    same shape holds consistent data. ``transpose`` splits every TP-split
    tensor on the other axis (a resharded load of the same checkpoint).
    """
    tp_rank, dp_rank = rank % tp, rank // tp
    sd: dict = {}
    for name, (gshape, axis) in shape.params().items():
        if axis is not None and transpose:
            axis = 1 - axis
        for kind, dtype in (("model", torch.bfloat16), ("main", torch.float32),
                            ("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)):
            key = f"{kind}.{name}"
            full = global_values(key, gshape, dtype)
            if axis is None:
                sd[key] = ShardedTensor.from_rank_offsets(key, full.to(device), replica_id=(tp_rank, dp_rank))
            else:
                local = full.chunk(tp, axis)[tp_rank].to(device, copy=True).contiguous()
                sd[key] = ShardedTensor.from_rank_offsets(key, local, (axis, tp_rank, tp), replica_id=dp_rank)
    return sd


def global_values(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Cheap, non-constant contents of a global tensor (constant data would flatter compressing filesystems)."""
    return torch.arange(math.prod(shape), dtype=torch.float32).mul_(1e-3).add_(len(key)).to(dtype).reshape(shape)
