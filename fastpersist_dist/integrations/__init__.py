"""Training frameworks' checkpointing through FastPersist: Megatron-LM (``megatron_lm``) and NeMo
(``nemo``), by replacing the names they build megatron-core strategies by (``compat/seams.py``).
Users import them as ``fastpersist_dist.megatron_lm`` and ``fastpersist_dist.nemo``."""
