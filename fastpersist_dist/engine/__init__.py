"""Save and load orchestration over the storage layer: staging and snapshots, the agreement of ranks
before anything is written, the commit protocol, the rank's writer process and the async queue.

Kept free of eager imports: a rank's writer process imports ``writer_process`` and what it writes with,
nothing of the commit, the index or megatron-core (``util/roles.py``)."""
