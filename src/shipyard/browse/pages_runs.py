"""Runs: a run's curves and evaluations, two runs compared, and the batch the loader gave any step.

The batch page calls the trainer's own data code (`train.trainer.load_data` on the run's
config.yaml, then `loader.rows(step)`): the rows shown are the ones the train step got, not a
re-implementation's guess (tests/test_browse.py compares them token for token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from shipyard.browse.html import chart, esc, page, table

CURVES = (
    ("loss", ("loss", "val_loss")),
    ("learning rate", ("lr",)),
    ("gradient norm", ("grad_norm",)),
    ("tokens/s", ("tokens_per_s",)),
    ("MFU", ("mfu",)),
    ("reward (RL)", ("reward_mean", "eval_reward", "eval_pass@1")),
    ("KL (RL)", ("kl_ref", "kl_rollout")),
)
"""The charts of a run page: title -> the metrics.jsonl keys drawn on it."""
ROWS_SHOWN = 8
"""Rows of a batch shown (a global batch can hold thousands)."""


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest still draws
    return out


def _series(records: list[dict], key: str) -> list[tuple[float, float]]:
    return [
        (float(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and "step" in r and math.isfinite(float(r[key]))
    ]


def _config(run: Path) -> dict:
    path = run / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def is_rl(node) -> bool:
    """An RL run (`shipyard rl`'s OUT): its batches are rollouts, not the loader's rows."""
    return (node.path / "rl.yaml").is_file()


def shown_steps(node) -> list[int]:
    """The steps whose batch pages a static site holds: the first, the middle, the last (none for an
    RL run)."""
    if is_rl(node):
        return []
    steps = _config(node.path).get("train", {}).get("steps") or 1
    return sorted({0, steps // 2, max(steps - 1, 0)})


def run_page(site, node) -> str:
    records = _metrics(node.path)
    charts = ""
    for title, keys in CURVES:
        series = {k: _series(records, k) for k in keys}
        series = {k: v for k, v in series.items() if v}
        if series:
            charts += chart(title, series)
    evals = _evals(site, node)
    steps = shown_steps(node)
    batches = " · ".join(f'<a href="../batch/{esc(node.key)}/{s}.html">step {s}</a>' for s in steps)
    form = ""
    if is_rl(node):
        batches = "an RL run's batches are its rollouts (metrics.jsonl), not the loader's rows"
    elif site.live:  # a server computes any step; a static site holds the few above
        form = (
            f'<form class=step data-base="../batch/{esc(node.key)}/"><label>batch at step '
            "<input name=step type=number min=0 value=0></label> <button>show</button></form>"
        )
    last = records[-1] if records else {}
    facts = table(
        ["", ""],
        [
            [esc(k), esc(f"{v:.6g}" if isinstance(v, float) else v)]
            for k, v in last.items()
            if not isinstance(v, dict)
        ],
    )
    body = (
        f'<p><a href="../node/{esc(node.key)}.html">node</a> · {len(records)} metric lines</p>'
        + charts
        + "<h2>Evaluations</h2>"
        + (evals or "<p>none in this root</p>")
        + f"<h2>Batches</h2><p>{batches}</p>{form}"
        + "<h2>Last line of metrics.jsonl</h2>"
        + facts
    )
    return page(f"run {node.name}", body, "../", [(f"run/{node.key}.html", node.key)])


def evals_page(site) -> str:
    """Every evaluation in the root, one row per (eval step, domain), in the graph's order: the
    stages (base -> SFT -> DPO -> RL, as a root has them) side by side."""
    from shipyard.browse import graph

    depth = graph.depths(site.nodes)
    rows = []
    for n in sorted((n for n in site.nodes if n.kind == "eval"), key=lambda n: (depth[n.key], n.key)):
        path = n.path / "eval.json"
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        runs = [site.by_key[p] for p in n.parents if site.by_key[p].kind in ("train", "run")]
        run = f'<a href="run/{esc(runs[0].key)}.html">{esc(runs[0].name)}</a>' if runs else "-"
        base = (report.get("unigram_baseline") or {}).get("bits_per_byte")
        for domain, m in report.get("domains", {}).items():
            rows.append(
                [run, f'<a href="node/{esc(n.key)}.html">{esc(n.name)}</a>', esc(domain)]
                + [
                    esc(f"{m[k]:.4g}") if isinstance(m.get(k), (int, float)) else "-"
                    for k in ("loss", "bits_per_byte")
                ]
                + [esc(f"{base:.4g}") if isinstance(base, (int, float)) else "-", "-"]
            )
    rl = [n for n in site.runs() if (n.path / "rl.yaml").is_file()]
    for n in rl:  # an RL run's own held-out numbers (its metrics.jsonl's last evaluated step)
        last = next((r for r in reversed(_metrics(n.path)) if "eval_reward" in r), None)
        if last is not None:
            rows.append([f'<a href="run/{esc(n.key)}.html">{esc(n.name)}</a>', "rl held-out", esc(f"step {last['step']}"),
                         "-", "-", "-", esc(f"{last['eval_reward']:.4g}")])  # fmt: skip
    header = ["run", "evaluation", "domain", "loss", "bits/byte", "unigram bits/byte", "held-out reward"]
    body = table(header, rows) if rows else "<p>no evaluations in this root</p>"
    return page("evaluations", body, "", [("evals.html", "evaluations")])


def _evals(site, node) -> str:
    """Tables of the eval steps that read this run (and the RL steps' held-out numbers)."""
    out = []
    for n in site.nodes:
        if n.kind != "eval" or node.key not in n.parents:
            continue
        path = n.path / "eval.json"
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        rows = []
        for domain, m in report.get("domains", {}).items():
            rows.append([esc(domain), *(esc(f"{m.get(k, '-'):.4g}" if isinstance(m.get(k), float) else m.get(k, "-"))
                                        for k in ("loss", "bits_per_byte", "tokens"))])  # fmt: skip
        base = report.get("unigram_baseline")
        if base:
            rows.append(
                [
                    esc("unigram baseline"),
                    esc(f"{base.get('loss', 0):.4g}"),
                    esc(f"{base.get('bits_per_byte', 0):.4g}"),
                    "",
                ]
            )
        out.append(
            f'<h3><a href="../node/{esc(n.key)}.html">{esc(n.name)}</a></h3>'
            + table(["domain", "loss", "bits/byte", "tokens"], rows)
        )
    return "".join(out)


def compare_page(site, a, b) -> str:
    ra, rb = _metrics(a.path), _metrics(b.path)
    charts = ""
    for title, keys in CURVES:
        series = {}
        for n, records in ((a, ra), (b, rb)):
            for k in keys:
                pts = _series(records, k)
                if pts:
                    series[f"{n.name} {k}"] = pts
        if series:
            charts += chart(title, series)
    diff = [[esc(k), esc(va), esc(vb)] for k, va, vb in _diff(_config(a.path), _config(b.path))]
    shared = _shared(site, a, b)
    body = (
        f'<p><a href="../run/{esc(a.key)}.html">{esc(a.key)}</a> vs <a href="../run/{esc(b.key)}.html">{esc(b.key)}</a></p>'
        + "<h2>Config differences</h2>"
        + (table(["key", a.name, b.name], diff) if diff else "<p>the configs are equal</p>")
        + charts
        + "<h2>Shared artifacts</h2>"
        + shared
    )
    return page(f"{a.name} vs {b.name}", body, "../", [(f"compare/{a.key}__{b.key}.html", "compare")])


def _diff(x, y, prefix: str = "") -> list[tuple[str, str, str]]:
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in sorted(set(x) | set(y)):
            out += _diff(x.get(k), y.get(k), f"{prefix}{k}.")
        return out
    return [] if x == y else [(prefix.rstrip("."), json.dumps(x), json.dumps(y))]


def _ancestors(site, key: str) -> set[str]:
    by_key, out, todo = site.by_key, set(), [key]
    while todo:
        for p in by_key[todo.pop()].parents:
            if p not in out and p in by_key:
                out.add(p)
                todo.append(p)
    return out


def _shared(site, a, b) -> str:
    """The steps both runs were made from (the same directory: the same hash), and those only one was."""
    sa, sb = _ancestors(site, a.key), _ancestors(site, b.key)
    by_key = site.by_key
    rows = []
    for key in sorted(sa | sb):
        n = by_key[key]
        where = "both" if key in sa and key in sb else (a.name if key in sa else b.name)
        rows.append([f'<a href="../node/{esc(key)}.html">{esc(key)}</a>', esc(n.kind), esc(where)])
    return table(["step (name-hash)", "kind", "used by"], rows) if rows else "<p>no recorded inputs</p>"


def _loader(site, node):
    """The run's data as the trainer loads it (cached per site)."""
    key = ("loader", node.key)
    if key not in site.loaded:
        from shipyard.config import load_config
        from shipyard.data.tokenizer import load_tokenizer
        from shipyard.run.model_dir import tokenizer_of
        from shipyard.train.trainer import load_data

        cfg = load_config(str(node.path / "config.yaml"))
        data = load_data(cfg, say=lambda m: None)
        tok_dir = tokenizer_of(node.path, cfg)
        site.loaded[key] = (cfg, data, load_tokenizer(tok_dir) if tok_dir is not None else None)
    return site.loaded[key]


def batch_rows(site, node, step: int) -> dict:
    """{"tokens": [B, L], "loss_mask": [B, L-1] or None, "segment_ids": ... } of `step`: the loader's rows."""
    import numpy as np

    _, data, _ = _loader(site, node)
    rows = data.loader.rows(step)
    if isinstance(rows, dict):
        return {k: np.asarray(v) for k, v in rows.items()}
    tokens = np.asarray(rows)
    return {"tokens": tokens, "loss_mask": np.ones((tokens.shape[0], tokens.shape[1] - 1), np.float32)}


def batch_page(site, node, step: int) -> str:
    cfg, data, tok = _loader(site, node)
    rows = batch_rows(site, node, step)
    tokens, mask = rows["tokens"], rows.get("loss_mask")
    eos = (
        data.eos_id
        if data.eos_id is not None
        else data.loader.eos_id
        if hasattr(data.loader, "eos_id")
        else None
    )
    segment = rows.get("segment_ids")
    slots = rows.get("slots")  # preference rows: 2k the k-th pair's chosen reply, 2k + 1 its rejected one
    shown = []
    for r in range(min(ROWS_SHOWN, tokens.shape[0])):
        spans = []
        for t, token in enumerate(tokens[r].tolist()):
            if segment is not None and 0 < t < segment.shape[1] and segment[r, t] != segment[r, t - 1]:
                spans.append(f'<b class=seg title="segment {int(segment[r, t])}">│</b>')  # a new packed chat
            text = tok.decode([token], skip_special_tokens=False) if tok is not None else f"{token} "
            # position t is a target of the loss when mask[t - 1] (the prediction made at t - 1)
            trained = mask is not None and t > 0 and t - 1 < mask.shape[1] and mask[r, t - 1] > 0
            cls = ("t" if trained else "u") + (" eos" if eos is not None and token == eos else "")
            if trained and slots is not None and slots[r, t - 1] >= 0:
                cls += " ch" if slots[r, t - 1] % 2 == 0 else " rj"
            spans.append(f'<span class="{cls}" data-id="{token}" title="{token}">{esc(text)}</span>')
        shown.append(f'<div class=row data-row="{r}"><span class=rowno>{r}</span>{"".join(spans)}</div>')
    segments = ""
    if segment is not None:
        segments = "<p>│ marks where a packed row's next conversation (segment) starts.</p>"
    if slots is not None:
        segments += "<p>Preference pairs: a chosen reply's tokens in green, a rejected reply's in red.</p>"
    body = (
        f"<p>{tokens.shape[0]} rows x {tokens.shape[1]} tokens at step {step} (the first {min(ROWS_SHOWN, tokens.shape[0])} "
        "shown), from <code>train.trainer.load_data</code> on the run's config.yaml: the trainer's own loader. "
        "Shaded: tokens the loss trains on (their loss_mask); boxed: end-of-document tokens.</p>"
        + "".join(shown)
        + segments
        + f'<p><a href="../../run/{esc(node.key)}.html">run</a></p>'
    )
    return page(f"batch at step {step} of {node.name}", body, "../../", [(f"run/{node.key}.html", node.key)])
