"""``python -m tests.cross_stack save|load DIR``: one side of the cross-stack test, run by the other venv.

Saves (2 ranks) or loads and checks (1 and 2 ranks) :func:`tests.states.dtype_state`
in the torch_dist format, on whichever megatron-core runs it: loads both with a plain ``load``
(our verifying loader) and with megatron's own loader named explicitly.
"""

from __future__ import annotations

import sys

from fastpersist_dist.tools.ranks import run_ranks

from .helpers import save
from .states import dcp_strategy, dtype_state, load_dtype_state_plain, load_dtype_state_stock

SALT = 7


def save_state(rank: int, world: int, path: str) -> None:
    save(dtype_state(rank, world, SALT), path, strategy=dcp_strategy(write_common_pt=True))


def load_and_check(rank: int, world: int, path: str) -> int:
    return load_dtype_state_plain(rank, world, path, SALT) + load_dtype_state_stock(rank, world, path, SALT)


def main(argv: list[str]) -> int:
    action, path = argv
    if action == "save":
        run_ranks(2, save_state, path)
    else:
        for world in (1, 2):
            run_ranks(world, load_and_check, path)
    print(f"cross_stack: {action} {path} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
