"""A training framework's strategy-building names, replaced by factories that return ours.

Megatron-LM and NeMo build their ``dist_checkpointing`` strategies by calling a
few names they import from megatron-core into a module of their own (Megatron-LM:
``megatron.training.checkpointing``; NeMo: ``nemo.lightning.io.pl`` and
``nemo.utils.callbacks.dist_ckpt_io``). Replacing exactly those names in exactly
those modules routes the framework's checkpoints through FastPersist while
everything around them (strategy wrappers, async queues, ``metadata.json``,
resume) stays the framework's own. megatron-core builds its default loader the
same way: ``compat``'s adapters replace that name (``register``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Mapping, Sequence

from ..util.errors import FastPersistError

logger = logging.getLogger(__name__)

MEGATRON_CORE = "megatron-core"  # the framework whose own names compat's adapters replace (``register``)

# (framework, module or class, name) -> what the framework had there before the first replace()
_originals: dict[tuple[str, Any, str], Any] = {}


class StrategyFactory:
    """Stands in for one strategy-building name of a framework and returns our strategy.

    The framework's arguments to the original (a format name, a checkpoint
    directory, torch_dist options such as ``cache_metadata`` or ``thread_count``)
    do not apply to ours and are ignored. The one instance is shared by every
    call, so its write plan, snapshot buffer and loaded ops last the whole run
    even where the framework builds a strategy per save.
    """

    def __init__(self, replaces: str, strategy: Any):
        self.replaces = replaces
        self.strategy = strategy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        logger.debug("fastpersist: asked %s(%s) for a strategy; using %s", self.replaces,
                     ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]),
                     type(self.strategy).__name__)
        return self.strategy


def factories(strategies: Mapping[str, Any]) -> dict[str, StrategyFactory]:
    """A :class:`StrategyFactory` for each strategy-building name."""
    return {name: StrategyFactory(name, strategy) for name, strategy in strategies.items()}


def replace(framework: str, modules: Sequence[Any], replacements: Mapping[str, Any], mismatch: str) -> None:
    """Set each name of ``replacements`` in every module (or class: a method); all or nothing: checks every one
    has every name first.

    ``mismatch`` ends the error raised when a module lacks a name: which
    version of the framework builds its strategies that way.
    """
    for module in modules:
        for name in replacements:
            if (framework, module, name) not in _originals and not hasattr(module, name):
                raise FastPersistError(
                    f"{getattr(module, '__file__', module.__name__)} has no {name}: this {framework} does not build "
                    f"its checkpoint strategies {mismatch}"
                )
    for module in modules:
        for name, replacement in replacements.items():
            _originals.setdefault((framework, module, name), getattr(module, name))
            setattr(module, name, replacement)


def original(framework: str, module: ModuleType, name: str) -> Any:
    """What ``framework`` had as ``module.name`` before the first :func:`replace` (what it has, before one)."""
    return _originals.get((framework, module, name), getattr(module, name, None))


def restore(framework: str) -> None:
    """Give ``framework``'s modules their own names back (no-op where nothing was replaced)."""
    for key in [key for key in _originals if key[0] == framework]:
        _, module, name = key
        setattr(module, name, _originals.pop(key))
        logger.debug("fastpersist: %s.%s restored", module.__name__, name)
