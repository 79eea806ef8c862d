"""The command hides its dependencies' known warnings in its own processes, and only there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastpersist_dist.util.quiet import LOGGED, WARNINGS

pytestmark = pytest.mark.engine

# Emits every known warning and one unknown of each kind, here and in a child interpreter.
EMIT = """
import logging, subprocess, sys, warnings
{setup}
from fastpersist_dist.util.quiet import LOGGED, WARNINGS
logging.basicConfig(format="%(name)s: %(message)s")
for category, start in WARNINGS:
    warnings.warn(start + " (here)", category)
for name, starts in LOGGED.items():
    for start in starts:
        logging.getLogger(name).warning(start + " (here)")
warnings.warn("unknown warning (here)", UserWarning)
logging.getLogger("DeepSpeed").warning("unknown record (here)")
child = "import warnings\\nfor c, s in %r: warnings.warn(s + ' (child)', getattr(__builtins__, c))" % (
    [(c.__name__, s) for c, s in WARNINGS],)
subprocess.run([sys.executable, "-c", child], check=True)
"""


def _stderr(setup: str) -> str:
    # without what the command, run in this process by other tests, left in the environment
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FASTPERSIST_QUIET")}
    proc = subprocess.run([sys.executable, "-c", EMIT.format(setup=setup)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_command_processes_hide_the_known_warnings_and_keep_the_rest():
    """A command (here ``inspect`` of a directory that is not there) imports the package quietly."""
    err = _stderr("from fastpersist_dist_cli import main\nmain(['inspect', '/nonexistent/fastpersist-quiet'])")
    known = [start for _, start in WARNINGS] + [start for starts in LOGGED.values() for start in starts]
    assert not [start for start in known if start in err], err
    assert "unknown warning (here)" in err and "unknown record (here)" in err


def test_importing_the_library_hides_nothing():
    err = _stderr("import fastpersist_dist")
    for _, start in WARNINGS:
        assert f"{start} (here)" in err and f"{start} (child)" in err, start
    for starts in LOGGED.values():
        assert all(f"{start} (here)" in err for start in starts), starts


def test_processes_started_by_a_command_import_the_library_quietly():
    """Our writer process (a fresh interpreter) imports the package under the command's FASTPERSIST_QUIET."""
    err = _stderr("import os\nfrom fastpersist_dist_cli import QUIET_ENV\nos.environ[QUIET_ENV] = '1'\n"
                  "import fastpersist_dist")
    known = [start for _, start in WARNINGS] + [start for starts in LOGGED.values() for start in starts]
    assert not [start for start in known if start in err], err


def test_known_warnings_fit_pythonwarnings():
    assert all("," not in start and ":" not in start for _, start in WARNINGS)
