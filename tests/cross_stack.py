"""``python -m tests.cross_stack save|load DIR``: one side of the cross-stack test, run by the other venv.

Saves (2 ranks) or loads and checks (1 and 2 ranks) :func:`tests.test_torch_dist_format.state`
in the torch_dist format, on whichever megatron-core runs it: loads both with a plain ``load``
(our verifying loader) and with megatron's own loader named explicitly.
"""

from __future__ import annotations

import sys

from .helpers import save
from .multiproc import run_ranks
from .test_torch_dist_format import _load_plain, _load_stock, state, strategy

SALT = 7


def _save(rank: int, world: int, path: str) -> None:
    save(state(rank, world, SALT), path, strategy=strategy(write_common_pt=True))


def _load(rank: int, world: int, path: str) -> int:
    return _load_plain(rank, world, path, SALT) + _load_stock(rank, world, path, SALT)


def main(argv: list[str]) -> int:
    action, path = argv
    if action == "save":
        run_ranks(2, _save, path)
    else:
        for world in (1, 2):
            run_ranks(world, _load, path)
    print(f"cross_stack: {action} {path} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
