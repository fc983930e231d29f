"""A real S3-compatible server for tests: ``moto_server`` as a subprocess on a free loopback port.

Import the fixtures into a test module (or a conftest) with
``from tests.integration.s3_fixtures import moto_s3, s3_store  # noqa: F401``. ``moto_s3`` is one
server per test session; tests that pause or kill the server (outage tests) start their own with
:class:`MotoServer` directly. Clients speak real HTTP to it through boto3 with fake credentials.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from worker.delivery.s3_store import S3ObjectStore

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """One ``moto_server`` process. ``pause()``/``resume()`` freeze it (SIGSTOP/SIGCONT): clients
    connect but get no answer, like an unreachable endpoint; ``stop()`` kills it for good."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("moto_server")
        self._log = open(os.devnull, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)

    def client(self):  # type: ignore[no-untyped-def]
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def store(self, bucket: str | None = None, **kwargs: object) -> S3ObjectStore:
        return S3ObjectStore(
            bucket or self.make_bucket(), endpoint_url=self.endpoint_url, region=REGION,
            access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, **kwargs,  # type: ignore[arg-type]
        )

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_store(moto_s3: MotoServer) -> S3ObjectStore:
    """A fresh bucket on the session's moto_server, as an :class:`S3ObjectStore`."""
    return moto_s3.store()
