"""shipyard.storage against a real S3-protocol server (moto) on 127.0.0.1, with faults injected."""

import signal
import subprocess
import sys
import threading
import time

import pytest
from s3_fixtures import FaultProxy

from shipyard import storage
from shipyard.storage import Retry, StorageError


def test_urls_redacted_joined_and_schemes_checked():
    assert storage.redact("s3://AKIA:secret@bkt/a/b?X-Amz-Signature=zz") == "s3://bkt/a/b"
    assert storage.redact("/tmp/x") == "/tmp/x"
    assert storage.join("s3://b/root/", "step", "f.json") == "s3://b/root/step/f.json"
    assert storage.is_url("memory://x") and storage.is_url("s3://b") and not storage.is_url("file:///tmp/x")
    assert storage.local("file:///tmp/x") == storage.local("/tmp/x")
    with pytest.raises(StorageError, match="scheme 'htp'; expected a local path or one of s3://"):
        storage.check_scheme("htp://b/x", "data.path")


def test_ranges_listing_and_publication_on_s3(bucket, tmp_path):
    url = f"{bucket}/obj.bin"
    storage.write_bytes(url, bytes(range(256)) * 4)
    reader = storage.RangeReader(url)
    assert reader.size == 1024 and reader.read(250, 260) == bytes(range(250, 256)) + bytes(range(4))

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.txt").write_text("b")
    dest = f"{bucket}/published"
    assert not storage.is_published(dest)
    storage.publish_dir(src, dest)
    assert storage.is_published(dest)
    assert storage.list_files(dest) == ["_SUCCESS", "a.txt", "sub/b.txt"]
    back = storage.download_dir(dest, tmp_path / "back")
    assert (back / "sub" / "b.txt").read_text() == "b"

    # publishing again replaces the old files: nothing stale survives next to the new marker
    (src / "a.txt").unlink()
    (src / "c.txt").write_text("c")
    storage.publish_dir(src, dest)
    assert storage.list_files(dest) == ["_SUCCESS", "c.txt", "sub/b.txt"]
    with pytest.raises(StorageError, match="reading s3://.*/missing: not found"):
        storage.read_bytes(f"{bucket}/missing")


def test_a_publication_killed_mid_upload_is_not_complete(bucket, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}").write_bytes(bytes([i]) * 200_000)
    dest = f"{bucket}/p"
    storage.publish_dir(src, dest)
    assert storage.is_published(dest)
    # publish new files there in a process SIGKILLed once some of them are up
    for i in range(40):
        (src / f"f{i:02d}").rename(src / f"g{i:02d}")
    code = f"from shipyard import storage; storage.publish_dir({str(src)!r}, {dest!r})"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    new = lambda: [n for n in storage.list_files(dest) if n.startswith("g")]  # noqa: E731
    while len(new()) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 0 < len(new()) < 40, f"killed too late or too early: {len(new())} new objects"
    # the earlier, complete publication's marker went first: the half-new prefix is not complete
    assert not storage.is_published(dest)


def test_every_third_connection_dropped_is_ridden_out(s3_server, bucket, monkeypatch):
    proxy = FaultProxy(s3_server.port, drop_every=3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no botocore retries: shipyard's backoff does it all
    logged = []
    for i in range(12):
        url = f"{bucket}/drop/{i}"
        storage.retrying(
            lambda url=url, i=i: storage.filesystem(url)[0].pipe_file(url, b"x" * i), "put", log=logged.append
        )
    assert [storage.read_bytes(f"{bucket}/drop/{i}") for i in range(12)] == [b"x" * i for i in range(12)]
    assert proxy.dropped >= 2, "the proxy dropped nothing: the test tested nothing"
    proxy.close()


def test_response_bodies_cut_short_are_read_again(s3_server, bucket, monkeypatch):
    """Every second connection's response stops halfway through its body: ranged reads still get
    exactly their bytes (the client notices the short body, shipyard retries)."""
    data = bytes(range(256)) * 512
    url = f"{bucket}/cut/obj"
    storage.write_bytes(url, data)
    proxy = FaultProxy(s3_server.port, truncate_every=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no botocore retries: shipyard's backoff does it all
    reader = storage.RangeReader(url, Retry(attempts=8, first_delay=0.01))
    for start, end in [(0, 40_000), (1_000, 131_072), (77, 78), (65_536, 100_000)]:
        assert reader.read(start, end) == data[start:end]
    assert proxy.truncated >= 2, "no body was cut: the test tested nothing"
    proxy.close()


def test_a_short_read_the_client_did_not_notice_is_read_again(monkeypatch):
    """A store whose client hands back fewer bytes than asked without an error (the branch a
    truncation the transport misses reaches): the range is read again, never returned short."""
    url = "memory://shipyard-short/obj"
    data = bytes(range(256)) * 8
    storage.write_bytes(url, data)
    reader = storage.RangeReader(url, Retry(attempts=3, first_delay=0.01))
    fs, real, calls = storage.filesystem(url)[0], storage.filesystem(url)[0].cat_file, []

    def short_once(path, start=None, end=None):
        calls.append((start, end))
        got = real(path, start=start, end=end)
        return got[:-7] if len(calls) == 1 else got

    monkeypatch.setattr(fs, "cat_file", short_once)
    assert reader.read(10, 1_500) == data[10:1_500] and calls == [(10, 1_500)] * 2


def test_an_outage_of_seconds_is_retried_with_backoff(s3_server, bucket, monkeypatch):
    proxy = FaultProxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no botocore retries: shipyard's backoff does it all
    storage.write_bytes(f"{bucket}/o/before", b"1")
    proxy.outage(3.0)
    logged, t = [], time.monotonic()
    url = f"{bucket}/o/during"
    storage.retrying(
        lambda: storage.filesystem(url)[0].pipe_file(url, b"2"), f"writing {url}", log=logged.append
    )
    assert time.monotonic() - t >= 2.5 and storage.read_bytes(url) == b"2"
    assert logged and all("retrying in" in line for line in logged), logged
    proxy.close()


def test_a_server_stopped_for_seconds_is_waited_out(s3_server, bucket):
    storage.write_bytes(f"{bucket}/before", b"1")
    s3_server.pause()
    timer = threading.Timer(3.0, s3_server.resume)
    timer.start()
    t = time.monotonic()
    try:
        storage.write_bytes(f"{bucket}/during", b"2", retry=Retry(attempts=12, first_delay=0.2, max_delay=2))
    finally:
        timer.join()
        s3_server.resume()
    assert time.monotonic() - t >= 2.5 and storage.read_bytes(f"{bucket}/during") == b"2"


@pytest.mark.slow
def test_a_store_down_past_the_retries_is_one_line(s3_server, bucket, monkeypatch):
    proxy = FaultProxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    proxy.outage(60)
    with pytest.raises(StorageError, match=r"reading s3://shipyard-\w+/x: .* after 3 tries") as e:
        storage.read_bytes(f"{bucket}/x", retry=Retry(attempts=3, first_delay=0.05))
    assert "\n" not in str(e.value)
    proxy.close()
