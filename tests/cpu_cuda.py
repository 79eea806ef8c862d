"""Stand-ins for the torch.cuda calls megatron code makes unconditionally, on a machine without CUDA.

They stub the platform, not the code under test: device selection and
synchronization become no-ops, the "current device" is the CPU (megatron's
collectives then allocate their flag tensors there, which gloo needs), the CUDA
RNG state is the CPU one (Megatron-LM saves and restores it with every
checkpoint), ``Tensor.cuda()`` keeps a tensor where it is (megatron's
fully-parallel load exchanges shards on the GPU) and tensors created with
``device="cuda"`` (loss scale, grad norm, exchange buffers) are created on the
CPU. Used by ``tests/megatron_lm_site/sitecustomize.py`` (Megatron-LM's
training code) and ``tests/test_nemo.py``.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _Stream:  # CPU work is already in order
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _on_cpu(device):
    return "cpu" if str(device).startswith("cuda") else device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return func(*args, **kwargs)


def stand_in_for_cuda(spawned_worker: bool = False) -> None:
    """Install the stand-ins for the life of the process (nothing where CUDA is available).

    ``spawned_worker``: megatron's spawned checkpoint worker, which calls
    ``set_device(rank % device_count())``.
    """
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    if spawned_worker:
        torch.cuda.device_count = lambda: 1  # (only here, and is_available() kept False: DeepSpeed asks it)
        torch.cuda.is_available = lambda: False
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    torch.cuda.manual_seed = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.Stream = lambda *args, **kwargs: _Stream()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _CudaToCpu().__enter__()  # for the life of the process
