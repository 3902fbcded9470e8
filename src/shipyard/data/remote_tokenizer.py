"""A tokenizer named by URL: a published directory (`s3://bucket/tok`, a `tokenizer-train --out URL`
output) or a file in one (`s3://bucket/tok/tokenizer.json`), fetched once into
`$XDG_CACHE_HOME/shipyard/tokenizers/<key>` and checked against its `_SUCCESS` listing
(see `published.fetch_published`)."""

from __future__ import annotations

from pathlib import Path

from shipyard import storage
from shipyard.data.published import cache_dir as _cache_dir
from shipyard.data.published import fetch_published

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""What a tokenizer directory may hold that loading it reads."""


def cache_dir() -> Path:
    """Where tokenizer URLs are cached: $XDG_CACHE_HOME/shipyard/tokenizers."""
    return _cache_dir("tokenizers")


def local_tokenizer(path: str | Path) -> Path:
    """A local path for tokenizer `path`: itself when local, else its cached download."""
    storage.check_scheme(path, "tokenizer")
    if not storage.is_url(path):
        return storage.local(path)
    url = str(path).rstrip("/")
    prefix, file = url.rsplit("/", 1) if url.endswith((".json", ".jinja")) else (url, None)
    dest = fetch_published(
        prefix,
        (*TOKENIZER_FILES, *([file] if file else [])),
        file or TOKENIZER_FILES[0],
        "tokenizers",
        f"tokenizer {storage.redact(url)}",
        "shipyard data tokenizer-train --out URL",
    )
    return dest / file if file else dest
