"""Site set-up for running Megatron-LM's training code in tests (tests/test_megatron_lm.py).

On PYTHONPATH this runs at the start of every Python process, including the checkpoint worker
that megatron-core's AsyncCallsQueue spawns. It appends the Megatron-LM checkout named by
FASTPERSIST_MEGATRON_LM to sys.path *after* site-packages (megatron.core stays the installed
package; megatron.training & co. come from the checkout). With FASTPERSIST_CPU_CUDA_SHIM=1 and
no CUDA it also stands in for the torch.cuda calls Megatron-LM's training code makes
unconditionally (``tests/cpu_cuda.py``: the platform, not the code under test).
"""

import os
import sys

if os.environ.get("FASTPERSIST_MEGATRON_LM"):
    sys.path.append(os.environ["FASTPERSIST_MEGATRON_LM"])

if os.environ.get("FASTPERSIST_CPU_CUDA_SHIM") == "1":
    from tests.cpu_cuda import stand_in_for_cuda  # the repository is on PYTHONPATH beside this directory

    stand_in_for_cuda(spawned_worker="--multiprocessing-fork" in sys.argv)
