"""What users run on checkpoints and machines: the ``fastpersist-dist`` commands (``cli``), ``verify``,
``inspect`` and the benchmarks (``bench``). The argument parsing is in the ``fastpersist_dist_cli`` package."""
