"""A real S3-protocol server on 127.0.0.1 (moto's standalone server) and a fault-injecting proxy.

`s3_server` (session scope) starts `moto_server` in a subprocess; `s3_env` points the
usual AWS environment variables at it (what boto3/s3fs read, and what a user's shell
would set), and `bucket` gives each test a fresh bucket URL. `FaultProxy` sits between
client and server: it drops every Nth connection (the client sees a reset) and can
refuse everything for a few seconds (an outage), so retries are tested against the
real protocol, not a mock.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ACCESS_KEY = "shipyard-test-key"
SECRET_KEY = "shipyard-test-secret-DO-NOT-LOG"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not listen on {port} within {timeout} s")


class S3Server:
    """moto_server in a subprocess; `pause`/`resume` stop and continue it (SIGSTOP/SIGCONT keeps
    its in-memory buckets, where a restart would lose them)."""

    def __init__(self):
        self.port = free_port()
        exe = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        self.proc.send_signal(19)  # SIGSTOP

    def resume(self) -> None:
        self.proc.send_signal(18)  # SIGCONT

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        self.proc.wait(timeout=10)


def aws_env(endpoint: str) -> dict[str, str]:
    """The environment a user would have for an S3-compatible store at `endpoint`."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        # botocore's own retries stay short, so shipyard's backoff is what rides out an outage
        "AWS_MAX_ATTEMPTS": "2",
        "AWS_RETRY_MODE": "standard",
    }


class FaultProxy:
    """A TCP proxy to `port`: every `drop_every`-th connection is closed as soon as the
    client has sent its first bytes (a reset mid-request); every `truncate_every`-th one passes
    its first response's headers and half its body, then closes (a body cut short);
    `outage(seconds)` refuses new connections and cuts open ones for that long."""

    def __init__(self, port: int, drop_every: int = 0, truncate_every: int = 0):
        self.upstream, self.drop_every, self.truncate_every = port, drop_every, truncate_every
        self.connections = self.dropped = self.truncated = 0
        self.bytes_down = 0  # bytes the server sent its clients through this proxy (bodies and headers)
        self._down_until = 0.0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def outage(self, seconds: float) -> None:
        self._down_until = time.monotonic() + seconds
        with self._lock:
            for s in list(self._open):
                _close(s)

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                n = self.connections
            if time.monotonic() < self._down_until:
                _close(client)
                continue
            drop = self.drop_every and n % self.drop_every == 0
            cut = self.truncate_every and n % self.truncate_every == 0
            threading.Thread(target=self._serve, args=(client, drop, cut), daemon=True).start()

    def _serve(self, client: socket.socket, drop: bool, cut: bool = False) -> None:
        if drop:
            with contextlib.suppress(OSError):
                client.recv(1)  # the client has started its request
            with self._lock:
                self.dropped += 1
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            _close(client)  # linger 0: a reset, as a dropped connection looks
            return
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open |= {client, server}
        a = threading.Thread(target=_pipe, args=(client, server), daemon=True)
        a.start()
        if cut:
            self._cut(server, client)
        else:
            _pipe(server, client, self._count_down)
        a.join()
        with self._lock:
            self._open -= {client, server}

    def _cut(self, server: socket.socket, client: socket.socket) -> None:
        """Pass the first response's headers and half its body (by its Content-Length), then close."""
        got = b""
        try:
            while b"\r\n\r\n" not in got and (data := server.recv(65536)):
                got += data
            head, _, body = got.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            want = int(length[1]) // 2 if length else 0
            while len(body) < want and (data := server.recv(65536)):
                body += data
            client.sendall(head + b"\r\n\r\n" + body[:want])
            if want:
                with self._lock:
                    self.truncated += 1
        except OSError:
            pass
        finally:
            _close(client)
            _close(server)

    def _count_down(self, n: int) -> None:
        with self._lock:
            self.bytes_down += n

    def close(self) -> None:
        self._stop = True
        _close(self._listener)


def _pipe(src: socket.socket, dst: socket.socket, count=None) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
            if count is not None:
                count(len(data))
    except OSError:
        pass
    finally:
        _close(dst)
        _close(src)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This process's environment pointed at the test server (subprocesses inherit it)."""
    for k, v in aws_env(s3_server.endpoint).items():
        monkeypatch.setenv(k, v)
    return aws_env(s3_server.endpoint)


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"shipyard-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name


@pytest.fixture
def bucket(s3_env, s3_server) -> str:
    """A fresh, empty bucket's URL, s3://shipyard-<random>."""
    return f"s3://{make_bucket(s3_server.endpoint)}"


def without_aws_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
