"""``python -m fastpersist_dist_cli``: the ``fastpersist-dist`` command."""

import sys

from . import main

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports it
    sys.exit(main())
