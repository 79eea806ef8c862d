"""Training frameworks' checkpointing through FastPersist: Megatron-LM (``megatron_lm``) and NeMo
(``nemo``), by replacing the names they build megatron-core strategies by (``compat/seams.py``);
torchtitan (``torchtitan``), by its checkpoint manager's subclass with our DCP writer and reader.
Users import them as ``fastpersist_dist.megatron_lm``, ``fastpersist_dist.nemo`` and
``fastpersist_dist.torchtitan``."""
