import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fastpersist_dist.dcp import FastPersistReader, FastPersistWriter
from fastpersist_dist.verify import verify_checkpoint

root = sys.argv[1]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(rank % torch.cuda.device_count())


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # FSDP2: each rank holds a shard of every parameter
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, optimizer):
    model(torch.randn(8, 64, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


model, optimizer = model_and_optimizer()
train_step(model, optimizer)

# 1. Synchronous save: each rank writes its shards through DeepNVMe, every byte checksummed; .metadata last.
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FastPersistWriter(f"{root}/step_1"))

# 2. Async save: DCP stages the state, the write goes on beside training; wait before the next save.
train_step(model, optimizer)
model_sd, optim_sd = get_state_dict(model, optimizer)
saving = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=FastPersistWriter(f"{root}/step_2"),
                        process_group=dist.new_group(backend="gloo"))
train_step(model, optimizer)  # training goes on meanwhile
saving.result()

# 3. Load into a fresh model (any world size: DCP's planner reshards), every block checked against its checksum.
fresh, fresh_optimizer = model_and_optimizer()
model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
state = {"model": model_sd, "optim": optim_sd}
dcp.load(state, storage_reader=FastPersistReader(f"{root}/step_1"))
set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

dist.barrier()
if rank == 0:
    report = verify_checkpoint(f"{root}/step_2")  # the same check as `fastpersist-dist verify`
    print(f"dcp: {world} ranks saved {root}/step_1 and {root}/step_2, loaded step_1; "
          f"verify: {'OK' if report.ok else report.problems}, {report.bytes_checked} bytes checked")
dist.destroy_process_group()
