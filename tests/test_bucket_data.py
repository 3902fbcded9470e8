"""Data stages with their inputs and outputs in a bucket (moto's S3 server on 127.0.0.1).

The bucket chain (extract → filter → dedup → tokenizer-train → tokenize, every input and output a
URL) must produce what the local chain produces, byte for byte once the recorded input paths are
mapped; through a proxy that drops connections too; and a stage killed mid-publication must leave
a prefix that the next stage refuses and `--overwrite` completes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from data_fixtures import mutate, prose, write_jsonl
from s3_fixtures import SECRET_KEY, FaultProxy

from shipyard import storage
from shipyard.cli.main import main
from shipyard.data.documents import ReadStats, read_documents

PAGE = "<html><head><title>t</title></head><body><nav>Home | About</nav><article><h1>{title}</h1><p>{body}</p></article></body></html>"
VOLATILE = ("seconds", "mb_per_s", "workers", "inputs")


def _raw(root: Path) -> Path:
    """HTML pages: distinct prose, exact and near duplicates, one too short to keep."""
    raw = root / "raw"
    raw.mkdir(parents=True)
    bodies = [prose(s, 200) for s in range(10)] + [
        prose(3, 200),
        mutate(prose(4, 200), 0.02, 1),
        "Too short.",
    ]
    for i, body in enumerate(bodies):
        (raw / f"p{i:02d}.html").write_text(PAGE.format(title=f"Page {i}", body=body))
    return raw


def _upload(local: Path, url: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes(f"{url}/{p.relative_to(local).as_posix()}", p.read_bytes())


def _chain(base: str | Path, raw: str | Path, workers: int, *extra: str) -> dict[str, str]:
    """The five stages, each reading the one before; returns stage -> output location."""
    out = {s: f"{base}/{s}" for s in ("extract", "filter", "dedup", "tok", "shards")}
    w = ["--workers", str(workers)]
    steps = [
        ["extract", str(raw), "--out", out["extract"], *w],
        ["filter", out["extract"], "--out", out["filter"], *w],
        ["dedup", out["filter"], "--out", out["dedup"], *w],
        ["tokenizer-train", out["dedup"], "--out", out["tok"], "--set", "vocab_size=300"],
        ["tokenize", out["dedup"], "--out", out["shards"], "--tokenizer", out["tok"], *w],
    ]
    for argv in steps:
        assert main(["data", *argv, *extra]) == 0, argv
    return out


def _files(loc: str, dest: Path) -> dict[str, bytes]:
    """Every file of a stage output (downloaded when it is a URL), by name."""
    dest = storage.download_dir(loc, dest) if storage.is_url(loc) else Path(loc)
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def _normal(name: str, data: bytes, raw: str) -> object:
    """A file's content with the places that name an input location (raw prefix, timings) made
    comparable: documents decompressed, stats and manifests parsed with volatile keys dropped."""
    if name.endswith(".jsonl.zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data).decode().replace(raw, "RAW")
    if name.endswith(".json") and name != "tokenizer.json":
        obj = json.loads(data.decode().replace(raw, "RAW"))
        for k in VOLATILE:
            obj.pop(k, None)
        obj.pop("sources", None)  # keyed by the input location of each stage
        obj.pop("model", None)  # classify: where its model was
        if isinstance(obj.get("tokenizer"), dict):
            obj["tokenizer"].pop("source")
        if isinstance(obj.get("config"), dict) and isinstance(obj["config"].get("tokenizer"), str):
            obj["config"]["tokenizer"] = obj["config"]["tokenizer"].split("@")[-1]
        return obj
    return data


def _compare(
    local: dict[str, str], remote: dict[str, str], raw_local: str, raw_remote: str, tmp: Path
) -> None:
    for stage in local:
        a = _files(local[stage], tmp / "a" / stage)
        b = _files(remote[stage], tmp / "b" / stage)
        assert {storage.MARKER, "_SHIPYARD_STAGE"} <= set(b), stage
        assert sorted(n for n in a if not n.startswith("_")) == sorted(n for n in b if not n.startswith("_"))
        for name in (n for n in a if not n.startswith("_")):  # the marker lists timings' hashes
            assert _normal(name, a[name], raw_local) == _normal(name, b[name], raw_remote), (stage, name)


def _no_secret(*roots: Path, text: str = "") -> None:
    assert SECRET_KEY not in text
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                assert SECRET_KEY.encode() not in p.read_bytes(), p


@pytest.mark.slow
def test_bucket_chain_equals_local_chain_and_records_no_credentials(bucket, tmp_path, capsys):
    raw = _raw(tmp_path / "in")
    local = _chain(tmp_path / "local", raw, 1)
    _upload(raw, f"{bucket}/raw")
    remote = _chain(f"{bucket}/out", f"{bucket}/raw", 2)  # workers 2 against the local chain's 1
    printed = capsys.readouterr()
    _compare(local, remote, str(raw), f"{bucket}/raw", tmp_path)
    shards = json.loads(storage.read_bytes(f"{remote['shards']}/manifest.json"))
    dedup = json.loads(storage.read_bytes(f"{remote['dedup']}/stats.json"))
    assert dedup["documents_in"] == 12 and dedup["documents_out"] == 11  # the too-short page and a duplicate
    assert shards["documents"] == 11 and shards["tokenizer"]["source"] == remote["tok"]
    marker = json.loads(storage.read_bytes(f"{remote['filter']}/{storage.MARKER}"))
    assert marker["stage"] == "filter" and "stats.json" in marker["files"]
    # the stage outputs name the bucket; no credential reaches a file or the terminal
    assert f"wrote {remote['shards']}" in printed.out
    _no_secret(tmp_path, text=printed.out + printed.err)

    # an existing output URL is refused like an existing directory; --overwrite replaces it
    argv = ["data", "filter", remote["extract"], "--out", remote["filter"]]
    assert main(argv) == 3 and "already exists; pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0


def _filter_and_tokenize(base: str, raw: str, tok: str, workers: int) -> dict[str, str]:
    out = {"filter": f"{base}/filter", "shards": f"{base}/shards"}
    w = ["--workers", str(workers)]
    assert main(["data", "filter", raw, "--out", out["filter"], *w]) == 0
    assert main(["data", "tokenize", out["filter"], "--out", out["shards"], "--tokenizer", tok, *w]) == 0
    return out


@pytest.mark.slow
def test_a_dropping_proxy_changes_nothing(bucket, tmp_path, s3_server, monkeypatch):
    raw = _raw(tmp_path / "in")
    raw_url, tok = f"{bucket}/raw", f"{bucket}/tok"
    _upload(raw, raw_url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["data", "tokenizer-train", raw_url, "--out", tok, "--set", "vocab_size=300"]) == 0
    direct = _filter_and_tokenize(f"{bucket}/direct", raw_url, tok, 1)
    # every 3rd connection reset: listings, ranged reads, uploads and the tokenizer download
    # (a fresh cache) all go through it, with two workers each opening their own connections
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))
    # (a reset at the start of a request is retried below shipyard, by the HTTP client stack; a cut
    # in the middle of a transfer is what shipyard's own retries are for: see the stream-cut test)
    proxy = FaultProxy(s3_server.port, drop_every=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        faulty = _filter_and_tokenize(f"{bucket}/proxied", raw_url, tok, 2)
        assert proxy.dropped >= 5, proxy.dropped
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    _compare(direct, faulty, raw_url, raw_url, tmp_path)


KILL_AFTER_FIRST_UPLOAD = """
import os, signal, sys
import s3fs
real = s3fs.S3FileSystem.put_file
def put_then_die(self, *a, **k):
    real(self, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-publication: one file up, the rest and the marker not
s3fs.S3FileSystem.put_file = put_then_die
from shipyard.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stage_killed_mid_publish_is_refused_until_rerun(bucket, tmp_path, capsys):
    raw = _raw(tmp_path / "in")
    _upload(raw, f"{bucket}/raw")
    out = f"{bucket}/filtered"
    argv = ["data", "filter", f"{bucket}/raw", "--out", out, "--workers", "1"]
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_UPLOAD, *argv], env=os.environ.copy())
    assert killed.returncode == -9
    left = storage.list_files(out)
    assert left and storage.MARKER not in left and "_SHIPYARD_STAGE" in left  # half published
    nxt = ["data", "dedup", out, "--out", f"{bucket}/dedup"]
    assert main(nxt) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        f"input {out} is not a complete stage output (no _SUCCESS): it was interrupted; rerun the stage"
        in err
    )
    assert not storage.list_files(f"{bucket}/dedup")
    assert main(argv) == 3 and "already exists" in capsys.readouterr().err  # not silently replaced
    assert main([*argv, "--overwrite"]) == 0 and storage.is_published(out)
    assert main(nxt) == 0 and storage.is_published(f"{bucket}/dedup")


def test_every_input_format_reads_the_same_from_a_bucket(bucket, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shipyard.data import documents

    src = tmp_path / "src"
    src.mkdir()
    texts = [prose(s, 60) for s in range(40)]
    write_jsonl(src / "a.jsonl", texts)  # split into line ranges below
    lines = (src / "a.jsonl").read_bytes()
    (src / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf, row_group_size=7)
    (src / "d.parquet").write_bytes(buf.getvalue())
    (src / "e.txt").write_text(texts[0])
    _upload(src, f"{bucket}/src")
    # small units, so the jsonl is read in line ranges and the parquet file in row groups
    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 2000)
    monkeypatch.setattr(documents, "MAX_UNIT_BYTES", 2000)
    units = documents.plan_units([f"{bucket}/src"])
    assert {u.kind for u in units} >= {"jsonl_range", "parquet_groups"}
    assert units == [
        documents.Unit(
            u.kind,
            tuple(p.replace(str(src), f"{bucket}/src") for p in u.paths),
            u.start,
            u.end,
            u.first_line,
            u.size,
        )
        for u in documents.plan_units([src])
    ]
    local, remote = ReadStats(), ReadStats()
    a = [(d.id.replace(str(src), "SRC"), d.text) for d in read_documents([src], local)]
    b = [(d.id.replace(f"{bucket}/src", "SRC"), d.text) for d in read_documents([f"{bucket}/src"], remote)]
    assert a == b and len(a) == 40 * 4 + 1 and remote.bad == {} and remote.bytes == local.bytes
    one = [d.text for d in read_documents([f"{bucket}/src/d.parquet"], ReadStats())]
    assert one == texts


def test_a_tokenizer_url_is_fetched_once_and_checked_against_its_marker(bucket, tmp_path, monkeypatch):
    from shipyard.data import remote_tokenizer
    from shipyard.data.tokenizer import load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    docs = write_jsonl(tmp_path / "d.jsonl", [prose(s, 80) for s in range(20)])
    tok = f"{bucket}/tok"
    assert main(["data", "tokenizer-train", str(docs), "--out", tok, "--set", "vocab_size=300"]) == 0
    enc = load_tokenizer(tok).encode("Kabel lodor.").ids
    assert load_tokenizer(f"{tok}/tokenizer.json").encode("Kabel lodor.").ids == enc
    # chat and preference data take the same URL (data.chat.tokenizer / data.preference.tokenizer)
    from shipyard.train.startup import chat_tokenizer_path

    assert (
        load_tokenizer(chat_tokenizer_path(f"{tok}/tokenizer.json", None)).encode("Kabel lodor.").ids == enc
    )
    cached = list(remote_tokenizer.cache_dir().iterdir())
    assert len(cached) == 1 and sorted(p.name for p in cached[0].iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # a file changed behind the marker's back is refused, not used
    storage.write_bytes(f"{tok}/tokenizer.json", storage.read_bytes(f"{tok}/tokenizer.json") + b" ")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))
    with pytest.raises(Exception, match="tokenizer.json has sha256 .* lists"):
        load_tokenizer(tok)
    storage.remove(f"{tok}/_SUCCESS")
    with pytest.raises(Exception, match=r"is not a complete publication \(no _SUCCESS\)"):
        load_tokenizer(tok)


def test_shards_written_to_a_bucket_match_their_manifest(bucket, tmp_path, capsys):
    docs = write_jsonl(tmp_path / "d.jsonl", [prose(s, 80) for s in range(20)])
    assert (
        main(
            ["data", "tokenizer-train", str(docs), "--out", str(tmp_path / "tok"), "--set", "vocab_size=300"]
        )
        == 0
    )
    out = f"{bucket}/shards"
    argv = [
        "data",
        "tokenize",
        str(docs),
        "--out",
        out,
        "--tokenizer",
        str(tmp_path / "tok"),
        "--set",
        "shard_tokens=500",
    ]
    assert main(argv) == 0
    manifest = json.loads(storage.read_bytes(f"{out}/manifest.json"))
    assert len(manifest["shards"]) > 1
    for shard in manifest["shards"]:
        data = storage.read_bytes(f"{out}/{shard['file']}")
        assert np.load(io.BytesIO(data)).shape == (shard["tokens"],)
    assert main(["data", "verify", out]) == 0
    assert f"documents match {out}/manifest.json" in capsys.readouterr().out


@pytest.mark.slow
def test_a_stream_cut_mid_file_is_retried_or_fails_in_one_line(
    bucket, tmp_path, s3_server, monkeypatch, capsys
):
    from shipyard.data import sources
    from shipyard.storage import Retry

    docs = write_jsonl(tmp_path / "d.jsonl", [prose(s, 100) for s in range(60)])
    _upload(tmp_path, f"{bucket}/in")
    argv = ["data", "filter", f"{bucket}/in/d.jsonl", "--workers", "1"]
    assert main([*argv, "--out", f"{bucket}/direct"]) == 0
    monkeypatch.setattr(sources, "BLOCK_BYTES", 4096)  # the file is read in ~10 ranged GETs
    monkeypatch.setattr(sources, "READ_RETRY", Retry(attempts=3, first_delay=0.3, max_delay=0.6))
    real = sources.RemoteFile.readinto
    proxy = FaultProxy(s3_server.port)
    cut = {"after": 3, "reads": 0, "seconds": 0.5}

    def read_then_cut(self, buffer):
        n = real(self, buffer)
        cut["reads"] += 1
        if cut["reads"] == cut["after"]:
            proxy.outage(cut["seconds"])  # open connections cut, new ones refused for a while
        return n

    monkeypatch.setattr(sources.RemoteFile, "readinto", read_then_cut)
    import s3fs

    # botocore and s3fs retry by themselves (s3fs alone would ride out a minute); with theirs down
    # to one try, what rides out the cut is shipyard's retry of the ranged GET (sources.READ_RETRY)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        # a short outage mid-file: the next ranged GET is retried and the output is the same
        assert main([*argv, "--out", f"{bucket}/cut"]) == 0
        assert cut["reads"] > cut["after"] + 3 and len(docs.read_bytes()) > 8 * 4096
        # an outage past the retries: one line naming the object and the byte range, nothing published
        cut.update(reads=0, seconds=60)
        capsys.readouterr()
        assert main([*argv, "--out", f"{bucket}/failed"]) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"reading {bucket}/in/d.jsonl bytes" in err and "after 3 tries" in err
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    # nothing published: the store was down, so what is there is the started run's tag and header
    # (a reader refuses the prefix; the same command run again resumes it)
    assert storage.list_files(f"{bucket}/failed") == [sources.STAGE_TAG, "_resume/header.json"]
    assert main([*argv, "--out", f"{bucket}/failed"]) == 0
    _compare({"f": f"{bucket}/direct"}, {"f": f"{bucket}/failed"}, bucket, bucket, tmp_path)
    _compare({"f": f"{bucket}/direct"}, {"f": f"{bucket}/cut"}, bucket, bucket, tmp_path)


def test_prepare_in_a_bucket_skips_what_is_published_and_redoes_a_cut_off_stage(bucket, tmp_path, capsys):
    raw = tmp_path / "in"
    raw.mkdir()
    write_jsonl(raw / "a.jsonl", [prose(s, 120) for s in range(12)] + [prose(2, 120), "too short"])
    _upload(raw, f"{bucket}/in")
    out = f"{bucket}/prepared"
    cfg = tmp_path / "prepare.yaml"
    cfg.write_text(
        f"inputs: [{bucket}/in]\nout: {out}\nworkers: 1\nfilter: {{min_words: 50}}\n"
        "tokenizer: {vocab_size: 300}\ntokenize: {shard_tokens: 1000}\n"
    )
    stages = ["01-filter", "02-dedup", "03-tokenizer", "04-tokenize-train"]
    assert main(["data", "prepare", str(cfg)]) == 0
    first = capsys.readouterr().out
    assert all(storage.is_published(f"{out}/{s}") for s in stages) and "done already" not in first
    summary = json.loads(storage.read_bytes(f"{out}/prepare.json"))
    assert (
        summary["train_shards"] == f"{out}/04-tokenize-train"
        and summary["tokenizer"] == f"{out}/03-tokenizer"
    )
    assert main(["data", "prepare", str(cfg)]) == 0
    assert capsys.readouterr().out.count("done already") == len(stages)
    # dedup's marker gone (as if its upload was cut off): dedup and everything after it are redone
    storage.remove(f"{out}/02-dedup/_SUCCESS")
    assert main(["data", "prepare", str(cfg)]) == 0
    again = capsys.readouterr().out
    assert "[01-filter] done already" in again and "[02-dedup] " + out in again
    assert "was not published completely; redoing it" in again and again.count("done already") == 1
    assert storage.is_published(f"{out}/02-dedup")
    _no_secret(tmp_path, text=first + again)


WORKERS_AFTER_ENV_CHANGE = """
import json, os, sys
from shipyard.cli.main import main
local, url, env = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
# the first pool starts the fork server, with no storage settings in the environment yet
assert main(["data", "filter", local, "--out", local + ".out", "--workers", "2"]) == 0
os.environ.update(env)  # then the user's settings arrive (a notebook, a wrapper script)
sys.exit(main(["data", "filter", url, "--out", url + ".out", "--workers", "2"]))
"""


def test_pool_workers_use_the_storage_settings_of_now(bucket, tmp_path, s3_env):
    from s3_fixtures import without_aws_env

    docs = write_jsonl(tmp_path / "d.jsonl", [prose(s, 80) for s in range(8)])
    _upload(tmp_path, f"{bucket}/in")
    script = [sys.executable, "-c", WORKERS_AFTER_ENV_CHANGE, str(docs), f"{bucket}/in", json.dumps(s3_env)]
    done = subprocess.run(script, env=without_aws_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert storage.is_published(f"{bucket}/in.out") and SECRET_KEY not in done.stdout + done.stderr


def test_classifier_train_and_classify_bucket_to_bucket_equal_local(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "pos.jsonl", [prose(s, 60) for s in range(80)])
    write_jsonl(src / "neg.jsonl", [" ".join(f"w{(s * 7 + i) % 97}" for i in range(60)) for s in range(80)])
    _upload(src, f"{bucket}/src")
    outs = {}
    for where, base, workers in (("local", str(tmp_path / "l"), 1), ("bucket", f"{bucket}/b", 2)):
        data = str(src) if where == "local" else f"{bucket}/src"
        model, cls = f"{base}/model", f"{base}/classify"
        train = ["--positive", f"{data}/pos.jsonl", "--negative", f"{data}/neg.jsonl", "--out", model]
        small = [
            "--set",
            "held_out_fraction=0.2",
            "--set",
            "bucket=20000",
            "--set",
            "dim=8",
        ]  # a small model.bin
        assert main(["data", "classifier-train", *train, *small]) == 0
        argv = [f"{data}/pos.jsonl", f"{data}/neg.jsonl", "--model", model, "--out", cls]
        assert main(["data", "classify", *argv, "--top-fraction", "0.5", "--workers", str(workers)]) == 0
        outs[where] = {"classify": cls}
    _compare(outs["local"], outs["bucket"], str(src), f"{bucket}/src", tmp_path)
    stats = json.loads(storage.read_bytes(f"{bucket}/b/classify/stats.json"))
    assert stats["model"] == f"{bucket}/b/model" and stats["documents_out"] == 80
