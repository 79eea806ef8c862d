"""Save a sharded state with FastPersist, load it resharded, save asynchronously, verify.

Run on CPU (gloo) or GPUs (NCCL), on megatron-core 0.16 or 0.17+:

    torchrun --nproc-per-node 2 examples/quickstart.py /tmp/fastpersist-quickstart
"""

import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from fastpersist_dist import (ASYNC_SAVE_KWARGS, AsyncSaveQueue, FastPersistLoadStrategy, FastPersistSaveStrategy,
                              prepare_checkpoint_dir)
from fastpersist_dist.verify import verify_checkpoint

root = sys.argv[1]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if torch.cuda.is_available():
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = "cuda" if torch.cuda.is_available() else "cpu"

# Each rank holds 8 rows of a (8 * world, 4) tensor; "step" is replicated on every rank.
full = torch.arange(8 * world * 4, dtype=torch.float32, device=device).reshape(8 * world, 4)
sd = {
    "weight": ShardedTensor.from_rank_offsets("weight", full[8 * rank : 8 * rank + 8].clone(), (0, rank, world)),
    "step": ShardedTensor.from_rank_offsets("step", torch.tensor([100], device=device), replica_id=rank),
}

# 1. Synchronous save: every rank writes its share through DeepNVMe.
ckpt = f"{root}/step_100"
prepare_checkpoint_dir(ckpt)  # collective: rank 0 creates it, every rank checks it can write there
dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy())

# 2. Load in another sharding (every rank the whole tensor), checksums verified.
whole = {"weight": ShardedTensor.from_rank_offsets("weight", torch.empty_like(full), replica_id=rank)}
loaded = dist_checkpointing.load(whole, ckpt, sharded_strategy=FastPersistLoadStrategy())
assert torch.equal(loaded["weight"], full)

# 3. Asynchronous save: the call returns once the state is snapshotted; training goes on.
queue = AsyncSaveQueue()
ckpt = f"{root}/step_200"
prepare_checkpoint_dir(ckpt)
request = dist_checkpointing.save(sd, ckpt, sharded_strategy=FastPersistSaveStrategy(),
                                  async_sharded_save=True, **ASYNC_SAVE_KWARGS)
queue.schedule(request)
sd["weight"].data.add_(1)  # the checkpoint keeps the values of the moment of the call
queue.close()  # collective: wait for the writers and commit (a loop calls maybe_finalize() each step)

# 4. Check every byte of the committed checkpoint (also: `fastpersist-dist verify DIR`).
if rank == 0:
    report = verify_checkpoint(ckpt)
    assert report.ok, report.problems
    print(f"quickstart: {world} ranks saved, loaded resharded and verified {ckpt}")
dist.destroy_process_group()
