"""FastPersist for every ``torch.distributed.checkpoint`` user (docs/dcp.md)::

    import torch.distributed.checkpoint as dcp
    from fastpersist_dist.dcp import FastPersistReader, FastPersistWriter

    dcp.save(state_dict, storage_writer=FastPersistWriter(path))
    dcp.load(state_dict, storage_reader=FastPersistReader(path))
"""

from .strategies.dcp_reader import FastPersistReader
from .strategies.dcp_writer import FastPersistWriter

__all__ = ["FastPersistReader", "FastPersistWriter"]
