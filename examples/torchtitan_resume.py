import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from fastpersist_dist.torchtitan import FastPersistCheckpointManager
from fastpersist_dist.verify import verify_checkpoint

root = sys.argv[1]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(rank % torch.cuda.device_count())
STEPS = 8


class TrainState:  # the trainer's own state in its checkpoints (torchtitan's Trainer.state_dict)
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


def train(stop_after):
    """What torchtitan's Trainer.train does around its checkpointer: resume, then a save call after every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    for layer in (model[0], model[2], model):  # FSDP2: each rank holds a shard of every parameter
        fully_shard(layer, mesh=init_device_mesh(device, (world,)))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="foreach").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    state = TrainState()
    # In a torchtitan config: Trainer.Config(..., checkpoint=FastPersistCheckpointManager.Config(...)).
    checkpointer = FastPersistCheckpointManager.Config(enable=True, interval=2, async_mode="async").build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=root)
    checkpointer.load()  # the latest checkpoint/step-N, every block checked; none at the first start
    resumed_at = state.step
    while state.step < stop_after:
        state.step += 1
        model(torch.randn(8, 64, device=device)).square().mean().backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        checkpointer.save(state.step, last_step=state.step == STEPS)  # every 2 steps, async; the last one sync
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    return resumed_at


train(stop_after=5)  # a job stopped after step 5 (its last checkpoint: step 4) ...
resumed_at = train(stop_after=STEPS)  # ... and restarted: it resumes from checkpoint/step-4

dist.barrier()
if rank == 0:
    saved = sorted(os.listdir(f"{root}/checkpoint"))
    report = verify_checkpoint(f"{root}/checkpoint/step-4")  # the same check as `fastpersist-dist verify`
    print(f"torchtitan: {world} ranks resumed at step {resumed_at}, saved {saved}; "
          f"verify step-4: {'OK' if report.ok else report.problems}, {report.bytes_checked} bytes checked")
dist.destroy_process_group()
