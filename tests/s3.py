"""A real S3 endpoint for the object-store tests: moto's server, a process of its own on a free port of 127.0.0.1,
and the AWS settings a client reads to reach it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import free_port

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoServer:
    """`moto_server` on 127.0.0.1; `auth`: it checks credentials (and knows none, so it refuses every key)."""

    def __init__(self, auth: bool = False) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.is_file():
            pytest.skip("moto's server is not installed: pip install -e '.[test]'")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {})}
        self.proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def env(self) -> dict[str, str]:
        """The AWS settings that point a client here."""
        return {**KEYS, "AWS_ENDPOINT_URL": self.url}


@contextmanager
def aws_env(settings: dict[str, str]) -> Iterator[None]:
    """These AWS settings for the block (and no config file or instance metadata that could override them)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            mp.delenv(name)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name, value in settings.items():
            mp.setenv(name, value)
        yield


def make_bucket(name: str) -> Any:
    """Create a bucket with the AWS settings in force; its client."""
    import boto3

    client = boto3.session.Session().client("s3")
    client.create_bucket(Bucket=name)
    return client
