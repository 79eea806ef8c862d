"""Megatron-LM's checkpoints through FastPersist: the entry point users import, or run with ``python -m``.

    import fastpersist_dist.megatron_lm
    fastpersist_dist.megatron_lm.enable()
    pretrain(...)

    torchrun --nproc-per-node 8 -m fastpersist_dist.megatron_lm pretrain_gpt.py <its arguments>

The integration itself is :mod:`fastpersist_dist.integrations.megatron_lm`.
"""

from .integrations.megatron_lm import disable, enable, main

__all__ = ["disable", "enable", "main"]

if __name__ == "__main__":
    main()
