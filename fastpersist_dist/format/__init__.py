"""The on-disk format, pure (no I/O, no collectives): records and the index, its pages, the two checkpoint
kinds (native ``fastpersist`` and ``torch_dist``), torch DCP's metadata and container, checksums, and the
geometry of shards (``layout``, ``coverage``). docs/format.md describes the files."""
