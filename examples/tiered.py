"""Tiered checkpoints: each node's local tier first, replicas on other nodes, the persistent tier in the
background; the state asked, an older checkpoint given up, durability waited for, and a load from the nearest
intact copy.

One machine, one node (no replicas possible):

    torchrun --nproc-per-node 2 examples/tiered.py /tmp/fastpersist-tiered/local /tmp/fastpersist-tiered/persistent

Two nodes (each with its own local directory at the same path), one replica of each node's files:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST0 examples/tiered.py /nvme/ckpt /lustre/run1
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr HOST0 examples/tiered.py /nvme/ckpt /lustre/run1
"""

import os
import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import (FastPersistLoadStrategy, FastPersistSaveStrategy, checkpoint_state,
                              prepare_checkpoint_dir, remove_checkpoint, wait_copies, wait_durable)

local_dir, persistent = sys.argv[1], sys.argv[2]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
full = torch.arange(8 * world * 4, dtype=torch.float32).reshape(8 * world, 4)
sd = {"weight": ShardedTensor.from_rank_offsets("weight", full[8 * rank : 8 * rank + 8].clone(), (0, rank, world))}

# Save: every rank writes its share into local_dir on its own node; the call returns once every node committed
# its copy ("local"). Replicas (with 2+ nodes) and the copy to the persistent tier go on in the background.
strategy = FastPersistSaveStrategy(local_dir=local_dir, replicas=min(1, nodes - 1), keep_local=2)
for step in (100, 200):  # a training loop, saving every 100 steps and keeping the newest checkpoint only
    ckpt = f"{persistent}/step_{step}"
    prepare_checkpoint_dir(ckpt)
    dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
    print(f"rank {rank}: {ckpt} is {checkpoint_state(ckpt)} right after the save")
    if step > 100 and rank == 0:  # the older one goes in the background, once this one is durable
        remove_checkpoint(f"{persistent}/step_{step - 100}")

# At the end: wait for durability, and for the background work (replicas, copies, removals) of this process.
assert wait_durable(ckpt, timeout=600) and wait_copies(timeout=600)
dist.barrier()

# Load: each rank reads from its node's local copy when it is intact, else a replica, else the persistent tier.
whole = {"weight": ShardedTensor.from_rank_offsets("weight", torch.empty_like(full), replica_id=rank)}
loaded = dist_checkpointing.load(whole, ckpt, sharded_strategy=FastPersistLoadStrategy())
assert torch.equal(loaded["weight"], full)
if rank == 0:
    print(f"tiered: {world} ranks on {nodes} node(s) saved {ckpt} to {local_dir}, now {checkpoint_state(ckpt)}; "
          f"{persistent}/step_100 removed: {not os.path.exists(f'{persistent}/step_100')}")
dist.destroy_process_group()
