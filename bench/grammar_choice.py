"""Which grammar library enforces `response_format` (inference/grammar.py): llguidance, xgrammar and
outlines-core side by side over bench/json_schemas.py's 60 schemas, with bench/serve_throughput.py's
8192-token byte-level BPE tokenizer.

Per library and schema: whether it compiles (or which part it refuses), the compile time (schema to
a ready matcher), and a walk of up to 96 tokens, each drawn at random from the library's own mask
(the end id taken with probability 0.3 once allowed): the time per mask, and whether the walk's
text, when it ends, parses and validates against the schema (`jsonschema`, an independent
validator: a library that allows a token it should not shows here). Same seed for every library.
Then six schemas with a keyword a library may not enforce (`not`, `if`/`then`, `uniqueItems`,
`dependentRequired`, an unknown format, minimum > maximum): refused (failing closed) or not.

llguidance is a dependency of shipyard; the other two are measured when importable (install them
into a scratch directory and put it on PYTHONPATH: xgrammar pulls triton and a TVM runtime, which
shipyard does not want as dependencies):

    .venv/bin/pip install --target /tmp/peers --no-deps xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=/tmp/peers .venv/bin/python bench/grammar_choice.py [--out bench/results/grammar_choice.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import json_schemas  # noqa: E402
import serve_throughput as bench  # noqa: E402 (the bench tokenizer)

STEPS = 96
END_P = 0.3
# Keywords a library may not enforce: it must refuse them (fail closed), not compile a looser grammar.
UNENFORCEABLE = {
    "not": {"type": "object", "properties": {"v": {"not": {"type": "string"}}}, "required": ["v"]},
    "if/then": {"type": "object", "properties": {"v": {"type": "integer"}}, "if": {"required": ["v"]}, "then": {"properties": {"v": {"minimum": 5}}}},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2, "maxItems": 2},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
    "unknown format": {"type": "string", "format": "zipcode"},
    "minimum > maximum": {"type": "integer", "minimum": 5, "maximum": 1},
}  # fmt: skip


def byte_vocab(tokenizer_json: str) -> tuple[list[bytes | None], list[int]]:
    """Each id's bytes (None for special tokens) and the special ids, for a byte-level BPE tokenizer:
    its vocabulary strings map back to bytes through GPT-2's byte-to-character table."""
    spec = json.loads(tokenizer_json)
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    size = max(spec["model"]["vocab"].values()) + 1
    special = [t["id"] for t in spec.get("added_tokens", [])]
    size = max(size, max(special, default=0) + 1)
    out: list[bytes | None] = [None] * size
    for text, i in spec["model"]["vocab"].items():
        if i not in special:
            out[i] = bytes(chars[c] for c in text)
    return out, special


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: list, eos: int):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=len(vocab), eos_token=eos)
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"

    def compile(self, schema: dict):
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=layout)
        failed, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if failed:
            raise ValueError(messages[0])
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def mask(self, m) -> np.ndarray:
        words = np.frombuffer(m.compute_bitmask(), np.uint32)
        return np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: list, eos: int):
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        encoded = [b if b is not None else b"" for b in vocab]
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
        self.size = len(vocab)
        self.version = getattr(xgrammar, "__version__", "?")

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask[0].numpy().view(np.uint32)
        return np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)[: self.size]

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json: str, vocab: list, eos: int):
        import outlines_core

        self.oc = outlines_core
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b is not None and i != eos:
                table.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, table)
        self.size = len(vocab)
        self.version = getattr(outlines_core, "__version__", "?")

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, m) -> np.ndarray:
        out = np.zeros(self.size, bool)
        out[m.get_tokens()] = True
        return out

    def consume(self, m, token: int) -> bool:
        try:
            m.advance(token)
            return True
        except Exception:
            return False


def walk(lib, matcher, vocab: list, eos: int, rng: random.Random) -> tuple[list[float], bytes | None]:
    """Mask times of a random walk through the grammar, and the text when it ended at the end id."""
    times, text = [], b""
    for _ in range(STEPS):
        t = time.perf_counter()
        allowed = lib.mask(matcher)
        times.append(time.perf_counter() - t)
        ids = np.flatnonzero(allowed)
        if len(ids) == 0:
            return times, None
        if allowed[eos] and (rng.random() < END_P or len(ids) == 1):
            return times, text
        token = int(rng.choice([i for i in ids.tolist() if i != eos]))
        if not lib.consume(matcher, token):
            return times, None
        text += vocab[token] or b""
    return times, None


def measure(lib, schemas: dict, vocab: list, eos: int) -> dict:
    import jsonschema

    rng = random.Random(0)
    rows, compile_ms, mask_us = {}, [], []
    for name, schema in schemas.items():
        t = time.perf_counter()
        try:
            matcher = lib.compile(schema)
        except Exception as e:  # the library's refusal: the part it cannot enforce
            rows[name] = {"supported": False, "why": " ".join(str(e).split())[:200]}
            continue
        compile_ms.append((time.perf_counter() - t) * 1e3)
        times, text = walk(lib, matcher, vocab, eos, rng)
        mask_us += [x * 1e6 for x in times]
        valid = None
        if text is not None:
            try:
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
        rows[name] = {
            "supported": True,
            "compile_ms": round(compile_ms[-1], 2),
            "tokens": len(times),
            "ended_valid": valid,
        }
    ended = [r["ended_valid"] for r in rows.values() if r.get("ended_valid") is not None]
    refused = {}
    for name, schema in UNENFORCEABLE.items():
        try:
            lib.compile(schema)
            refused[name] = False
        except Exception:
            refused[name] = True
    return {
        "refuses_unenforceable": sum(refused.values()),
        "unenforceable": refused,
        "version": lib.version,
        "supported": sum(r["supported"] for r in rows.values()),
        "compile_ms_median": round(statistics.median(compile_ms), 2) if compile_ms else None,
        "compile_ms_max": round(max(compile_ms), 2) if compile_ms else None,
        "mask_us_median": round(statistics.median(mask_us), 1) if mask_us else None,
        "mask_us_p99": round(float(np.percentile(mask_us, 99)), 1) if mask_us else None,
        "walks_ended": len(ended),
        "walks_ended_invalid": ended.count(False),
        "schemas": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/grammar_choice.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench.write_tokenizer(Path(tmp) / "tok", Path(tmp))
        tokenizer_json = (Path(tmp) / "tok" / "tokenizer.json").read_text()
    vocab, special = byte_vocab(tokenizer_json)
    eos = special[1] if len(special) > 1 else special[0]
    schemas = json_schemas.schemas()
    result = {"schemas": len(schemas), "vocab": len(vocab), "libraries": {}}
    for cls in (Llguidance, Xgrammar, OutlinesCore):
        try:
            lib = cls(tokenizer_json, vocab, eos)
        except ImportError as e:
            result["libraries"][cls.name] = {"skipped": f"not importable: {e}"}
            continue
        result["libraries"][cls.name] = measure(lib, schemas, vocab, eos)
        row = result["libraries"][cls.name]
        print(
            f"{cls.name:14s} supported {row['supported']}/{len(schemas)}  compile median {row['compile_ms_median']} ms "
            f"(max {row['compile_ms_max']})  mask median {row['mask_us_median']} us (p99 {row['mask_us_p99']})  "
            f"walks ended {row['walks_ended']}, invalid {row['walks_ended_invalid']}; "
            f"refuses {row['refuses_unenforceable']}/{len(UNENFORCEABLE)} unenforceable",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
