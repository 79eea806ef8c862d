"""Site set-up for running Megatron-LM's training code in tests (tests/test_megatron_lm.py).

On PYTHONPATH this runs at the start of every Python process, including the checkpoint worker
that megatron-core's AsyncCallsQueue spawns. It appends the Megatron-LM checkout named by
FASTPERSIST_MEGATRON_LM to sys.path *after* site-packages (megatron.core stays the installed
package; megatron.training & co. come from the checkout). With FASTPERSIST_CPU_CUDA_SHIM=1 and
no CUDA it also stands in for the torch.cuda calls Megatron-LM's training code makes
unconditionally. That stubs the platform, not the code under test: device selection and
synchronization become no-ops, the "current device" is the CPU (megatron's collectives then
allocate their flag tensors there, which gloo needs), the CUDA RNG state is the CPU one
(Megatron-LM saves and restores it with every checkpoint) and tensors that megatron-core creates
with ``device="cuda"`` (loss scale, grad norm) are created on the CPU.
"""

import os
import sys

if os.environ.get("FASTPERSIST_MEGATRON_LM"):
    sys.path.append(os.environ["FASTPERSIST_MEGATRON_LM"])

if os.environ.get("FASTPERSIST_CPU_CUDA_SHIM") == "1":
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.set_device = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        if "--multiprocessing-fork" in sys.argv:  # megatron's spawned checkpoint worker: set_device(rank % count)
            torch.cuda.device_count = lambda: 1  # (only here, and is_available() kept False: DeepSpeed asks it)
            torch.cuda.is_available = lambda: False
        torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        torch.cuda.set_rng_state = lambda *args, **kwargs: None
        torch.cuda.manual_seed = lambda *args, **kwargs: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self

        import contextlib

        class _Stream:  # CPU work is already in order
            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        torch.cuda.Stream = lambda *args, **kwargs: _Stream()
        torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
        torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()

        from torch.overrides import TorchFunctionMode

        def _on_cpu(device):
            return "cpu" if str(device).startswith("cuda") else device

        class _CudaToCpu(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if "device" in kwargs:
                    kwargs["device"] = _on_cpu(kwargs["device"])
                return func(*args, **kwargs)

        _CudaToCpu().__enter__()  # for the life of the process
