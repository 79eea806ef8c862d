"""The tests. Their ranks are forked from pytest's process (fastpersist_dist/tools/ranks.py).

Imports of DeepSpeed and megatron-core ask ``torch.cuda.is_available()``, which by
default initializes the CUDA driver in pytest's process, and every rank forked
after it fails at its first CUDA call. Asked through NVML it does not
(``tests/test_gpu.py`` on a GPU machine); the user's own setting wins.
"""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
