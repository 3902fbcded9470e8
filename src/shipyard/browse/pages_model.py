"""The model playground and the trace page: forms whose answers come from the server's API
(browse/server.py: /api/complete runs the serving engine on a checkpoint, /api/trace looks a span up
in the training shards). A static site shows them with a note that they need `shipyard browse`."""

from __future__ import annotations

from shipyard.browse.html import esc, page


def models(site) -> list:
    """The nodes a person can talk to: runs (their newest checkpoint) and HF exports."""
    return [n for n in site.nodes if n.kind in ("train", "run", "export-hf")]


def _picker(site) -> str:
    options = "".join(
        f'<option value="{esc(n.key)}">{esc(n.name)} ({esc(n.kind)})</option>' for n in models(site)
    )
    return f"<label>model <select name=model>{options}</select></label>"


def _offline(site) -> str:
    if site.live:
        return ""
    return (
        "<p class=note>This is a static copy: the answers come from a running <code>shipyard browse</code> "
        "(a server with the engine and the trace index), which a page opened from a file does not have.</p>"
    )


def model(site) -> str:
    body = (
        _offline(site)
        + '<form id=complete class=api data-api="api/complete">'
        + _picker(site)
        + " <label>mode <select name=mode><option>complete</option><option>chat</option></select></label>"
        + " <label>new tokens <input name=max_tokens type=number value=32 min=1 max=512></label>"
        + "<textarea name=prompt rows=4 cols=80>def </textarea><button>run</button></form>"
        + "<div id=answer class=answer></div>"
        + "<p>Each token shows its log-prob; hover it for the top alternatives. The answer names the "
        "model's content hash, its checkpoint and the shards it trained on.</p>"
    )
    return page("model playground", body, "")


def trace(site) -> str:
    body = (
        _offline(site)
        + "<p>Paste generated text (or any text): its spans of at least 4 tokens that occur word for word "
        "in a run's training shards are listed with the documents they come from (a suffix array over the "
        "shards, built once per shard set and cached).</p>"
        + '<form id=trace class=api data-api="api/trace">'
        + _picker(site)
        + "<textarea name=text rows=4 cols=80></textarea><button>trace</button></form>"
        + "<div id=spans class=answer></div>"
    )
    return page("trace text to training data", body, "")
