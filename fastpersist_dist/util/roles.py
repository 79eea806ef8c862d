"""Whether this process is a rank's writer process, which imports only the storage side.

The writer (``engine/writer_process.py``) writes snapshots with torch and DeepSpeed;
megatron-core there cost seconds of start-up and 300 to 430 MiB of private
memory per rank. Its trainer sets ``WRITER_ENV`` in the writer's environment;
the package then registers no strategies, and its errors derive from plain
``Exception`` (they leave the writer only as text: status files and replies).
"""

from __future__ import annotations

import os

WRITER_ENV = "FASTPERSIST_WRITER_PROCESS"
IS_WRITER = os.environ.get(WRITER_ENV) == "1"
