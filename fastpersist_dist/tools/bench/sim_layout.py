"""The megatron GPT layout the metadata simulation runs on (``simulate.py``): which records each rank of a
TP x PP x DP job with TransformerEngine layer keys (a prepended layer axis), bf16 weights and fp32 main/exp_avg/
exp_avg_sq states stages, with the distributed optimizer on or off."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ...format.records import KIND_OBJECT, KIND_TENSOR, ShardRecord
from ...util.config import WriteConfig

BLOCK_BYTES = WriteConfig().checksum_block_bytes  # the default checksum block

MiB = 1 << 20
ITEMSIZE = {"bfloat16": 2, "float32": 4}
STATES = (("", "bfloat16"), ("optimizer.state.fp32_param.", "float32"),
          ("optimizer.state.exp_avg.", "float32"), ("optimizer.state.exp_avg_sq.", "float32"))
TE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
EXTRA_STATE_BYTES = 1200  # a pickled TransformerEngine _extra_state (FP8 metadata), order of magnitude
RNG_STATE_BYTES = 5000  # a pickled megatron rng state (python, numpy, torch, cuda trackers)


@dataclass(frozen=True)
class Layout:
    """A megatron GPT run: rank = tp + TP * (dp + DP * pp) (megatron's default order tp-cp-ep-dp-pp)."""

    tp: int = 8
    pp: int = 16
    dp: int = 8
    layers: int = 96
    hidden: int = 12288
    vocab: int = 51200
    dist_opt: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def dp_group(self, t: int, p: int) -> list[int]:
        """Global ranks of the data-parallel group of tensor rank ``t`` in stage ``p``."""
        return [t + self.tp * (d + self.dp * p) for d in range(self.dp)]

    def layer_params(self) -> list[tuple[str, tuple[int, ...], Optional[int]]]:
        """(name, global shape of one layer's parameter, tensor-parallel axis or None), TE-fused GPT."""
        h = self.hidden
        return [
            ("self_attention.linear_qkv.layer_norm_weight", (h,), None),
            ("self_attention.linear_qkv.weight", (3 * h, h), 0),
            ("self_attention.linear_qkv.bias", (3 * h,), 0),
            ("self_attention.linear_proj.weight", (h, h), 1),
            ("self_attention.linear_proj.bias", (h,), None),
            ("mlp.linear_fc1.layer_norm_weight", (h,), None),
            ("mlp.linear_fc1.weight", (4 * h, h), 0),
            ("mlp.linear_fc1.bias", (4 * h,), 0),
            ("mlp.linear_fc2.weight", (h, 4 * h), 1),
            ("mlp.linear_fc2.bias", (h,), None),
        ]

    def held(self, t: int, d: int, p: int) -> list[ShardRecord]:
        """The records the rank (t, d, p) stages: every tensor shard it holds, its main-replica objects."""
        per_stage = self.layers // self.pp
        out: list[ShardRecord] = []
        for layer in range(p * per_stage, (p + 1) * per_stage):
            for name, shape, axis in self.layer_params():
                out += self._states(f"decoder.layers.{name}", shape, axis, t, d, layer)
            if d == 0:  # objects: only main replicas are staged
                out += [_object(f"decoder.layers.{m}._extra_state", (self.layers, self.tp), (layer, t),
                                EXTRA_STATE_BYTES) for m in TE_MODULES]
        if p == 0:
            out += self._states("embedding.word_embeddings.weight", (self.vocab, self.hidden), 0, t, d)
        if p == self.pp - 1:
            out += self._states("decoder.final_layernorm.weight", (self.hidden,), None, t, d)
            out += self._states("output_layer.weight", (self.vocab, self.hidden), 0, t, d)
        out.append(_object("rng_state", (self.pp, self.tp, self.dp), (p, t, d), RNG_STATE_BYTES))
        return out

    def _states(self, key: str, shape: tuple[int, ...], axis: Optional[int], t: int, d: int,
                layer: Optional[int] = None) -> list[ShardRecord]:
        """The bf16 weight and fp32 optimizer states of one parameter held by rank (t, d)."""
        local, offset = list(shape), [0] * len(shape)
        if axis is not None:
            local[axis] //= self.tp
            offset[axis] = t * local[axis]
        weight_replica = (0, 0 if axis is not None else t, d)
        out = []
        for prefix, dtype in STATES:
            loc, off, replica = list(local), list(offset), weight_replica
            if prefix and self.dist_opt:  # the distributed optimizer: states split over DP, no replicas
                if loc[0] % self.dp:
                    raise ValueError(f"{key}: {loc[0]} rows do not split over DP={self.dp}")
                loc[0] //= self.dp
                off[0] += d * loc[0]
                replica = (0, weight_replica[1], 0)
            out.append(_tensor(prefix + key, shape, tuple(loc), tuple(off), dtype, replica, layer, self.layers))
        return out


def _tensor(key: str, shape: tuple[int, ...], local: tuple[int, ...], offset: tuple[int, ...], dtype: str,
            replica: tuple[int, ...], layer: Optional[int], layers: int) -> ShardRecord:
    if layer is not None:  # megatron stacks layers: one key, a prepended layer axis
        shape, offset = (layers, *shape), (layer, *offset)
    return ShardRecord(
        key=key, kind=KIND_TENSOR, dtype=dtype, local_shape=local, global_shape=shape, global_offset=offset,
        axis_fragmentations=None, prepend_axis_num=0 if layer is None else 1, flattened_range=None,
        replica_id=replica, file="", offset=0, length=math.prod(local) * ITEMSIZE[dtype],
    )


def _object(key: str, shape: tuple[int, ...], offset: tuple[int, ...], nbytes: int) -> ShardRecord:
    return ShardRecord(
        key=key, kind=KIND_OBJECT, dtype=None, local_shape=(), global_shape=shape, global_offset=offset,
        axis_fragmentations=None, prepend_axis_num=0, flattened_range=None, replica_id=0, file="", offset=0,
        length=nbytes,
    )
