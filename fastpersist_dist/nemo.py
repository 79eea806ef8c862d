"""NeMo's checkpoints through FastPersist: the entry point users import.

    import fastpersist_dist.nemo
    fastpersist_dist.nemo.enable()
    trainer.fit(model, data)

The integration itself is :mod:`fastpersist_dist.integrations.nemo`.
"""

from .integrations.nemo import disable, enable

__all__ = ["disable", "enable"]
