"""Where shipyard keeps what it can fetch or compute again: one directory per user, by the XDG rule."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """$XDG_CACHE_HOME/shipyard/<parts>; ~/.cache when XDG_CACHE_HOME is unset or empty (an empty value
    is not the current directory: the XDG rule ignores it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "shipyard", *parts)
