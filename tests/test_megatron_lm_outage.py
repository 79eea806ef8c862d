"""Megatron-LM's training loop through the runner, tiered, with its checkpoints on an object store that goes down.

A real S3 server (SeaweedFS) is ``--save``; the two ranks' local tier is a directory of their node. The object
store is stopped right before the checkpoint of iteration 4 and started again once that checkpoint is committed
to the local tiers: training goes on, and the checkpoint becomes durable in the same process, with no new save.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future

import pytest

from fastpersist_dist import checkpoint_state
from fastpersist_dist.format.tiers import TIERS_FILE, local_copy_dir
from fastpersist_dist.storage.persistent import persistent_dir

from .test_megatron_lm import ASYNC, _run

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # object stores: megatron-core 0.19 (msc)

TRACKER = "latest_checkpointed_iteration.txt"


def _until(done, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.parametrize("saves", ["sync", "async"])
def test_an_object_store_down_at_a_save_does_not_stop_megatron_lm_training(megatron_lm_env, s3, tmp_path, saves):
    """S3 stopped before the save of iteration 4, started again 3 s after its local commit: every rank's save (and
    an async one's finalize) returns and training ends normally; the exit waits for the copies, so iteration 4 is
    durable and the tracker, written once it is, names it; a resume from S3 loads it with the values saved."""
    url = f"msc://s3/{uuid.uuid4().hex}/ckpt"
    ckpt, local, hold = tmp_path / "ckpt", tmp_path / "local-tier", tmp_path / "hold"
    for d in (ckpt, local, hold):
        d.mkdir()
    launcher = [sys.executable, "-m", "fastpersist_dist.megatron_lm"]
    extra = ["--enable-msc", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local),
             *(ASYNC if saves == "async" else [])]
    env = {**megatron_lm_env, "MSC_CONFIG": os.environ["MSC_CONFIG"], "HOLD_SAVE": f"4:{hold}"}
    trained: Future = Future()

    def train() -> None:
        try:
            trained.set_result(_run("train", ckpt, extra, launcher, env, save=url))
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            trained.set_exception(e)

    threading.Thread(target=train, daemon=True).start()
    _until(lambda: trained.done() or len(list(hold.iterdir())) == 2, "rank ready for the save of iteration 4")
    assert not trained.done(), trained.exception()
    assert checkpoint_state(f"{url}/iter_0000002") in ("local", "durable")
    s3.stop()
    (hold / "go").touch()
    committed = os.path.join(local_copy_dir(str(local), f"{url}/iter_0000004"), TIERS_FILE)
    _until(lambda: trained.done() or os.path.exists(committed), "local commit of iteration 4")
    time.sleep(3)
    s3.start()
    results = trained.result(timeout=540)
    assert all(r["saved"] == [2, 4] for r in results), results
    assert [checkpoint_state(f"{url}/iter_{i:07d}") for i in (2, 4)] == ["durable", "durable"]
    assert persistent_dir(url).read(TRACKER) == b"4"
    resume = _run("resume", ckpt, extra, launcher, {k: v for k, v in env.items() if k != "HOLD_SAVE"}, save=url)
    for result in resume:
        assert result["iteration"] == result["expected_iteration"] == 4, result
        assert result["mismatched"] == [] and result["optim_equal"] is True, result
