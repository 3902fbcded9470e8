"""Check that the docs name only things that exist: commands, flags, make targets, files, code, config keys.

    .venv/bin/python tools/check_docs.py [--repo ROOT] [FILES...]

Without FILES it checks README.md and docs/*.md of the repository (ROOT, default: the one this file
is in), and the docstrings of every module under src/shipyard (read as markdown, same checks; a bare
`--flag` in a docstring must be a flag of some shipyard command). Prints one line per problem, `file:line: what is named: why it is wrong`, and exits 1 if there
is any, 0 when clean. `make lint` runs it.

What is looked at: inline code spans (`...`, also across a line break) and the lines of fenced code
blocks. Plain prose is never checked.

1. Commands. A `shipyard` (or `.venv/bin/shipyard`, `$ shipyard`) token at command position (first
   token, or after `&&`, `;`, `$`) starts an invocation; it runs to the end of the span / line
   (code lines joined over trailing backslashes, `# comments` dropped) or the next `&&` / `;`.
   Words after it are matched against the subcommands that `shipyard [PATH] --help` lists (the real
   CLI, run once per command path, in parallel, and cached); `a|b|c` alternatives are each checked.
   An unknown word is reported in code blocks always; in an inline span only when the span also names a
   `--flag` or the word is close to a real subcommand (so a phrase such as `shipyard version changed`
   is not taken for a command). A placeholder (`STAGE`, `<x>`, `...`) ends the subcommand path and
   the flags after it are not checked. Every `--flag` after the path (also inside `[...]`, `(...)`,
   `--config/--set`, `--flag=value`) must appear in that command's help (usage and option lines).
   `python -m shipyard.lm_eval_adapter ...` is lm-eval's own CLI: `shipyard` there is not at command
   position, so its flags are skipped. Positional `dotted.key=value` arguments of commands that take
   overrides (their help lists an `overrides` positional) are checked as config keys (see 5), and so
   are the keys of a YAML mapping value (`"train.finetune={lora: {rank: 8}}"`).
   A span that is only a flag (`--compile-layers N`) must name a flag of one of the commands the same
   file names (with all their subcommands, plus the global flags); flags with an underscore
   (`--xla_force_host_platform_device_count`, lm-eval's `--num_fewshot`) and flags in a paragraph that
   mentions lm-eval / lm_eval belong to other programs and are skipped.
2. Make targets. `make TARGET` at command position must be a target of the Makefile.
3. Files. A token of a span or code line that looks like a repository path is checked to exist:
   every `*.py` name, and names with a known file extension whose first directory exists in the
   repository (`bench/results/x.json`, `configs/quickstart-data.yaml`). Each is looked up relative to
   the repository root, src/shipyard/ (the package layout `model/transformer.py`), src/ and the doc's
   directory; `*` globs must match something. Tokens with placeholders (`<run>`, `{`, `...`) are skipped.
4. Code references (inline spans). Forms:
   - `path.py: name` / `path.py:name` (e.g. `parallel/mesh.py: DEFAULT_RULES`; a repository file
     outside the package, such as `tests/test_train.py: test_bad_token_file`, is parsed the same way),
   - `path/module.Name` (e.g. `train/finetune.Partition`),
   - `dotted.module:name`,
   - dotted names `a.b.c` (e.g. `transformer.layer_windows`, `shipyard.interop.hf.load_run_params`).
   A module is named by any trailing part of its dotted name (`transformer` = shipyard.model.transformer,
   `interop.hf` = shipyard.interop.hf). The name after it must be defined at the top level of that
   module (def, class, assignment, import; parsed with ast, nothing is imported), then `Class.member`
   must be in the class body (or a base class defined in shipyard; a class with a base from elsewhere
   is given the benefit of the doubt). `module.method` is accepted when some class of that module has
   that method (docs often name an instance by its module). A name that starts with a shipyard class
   (`ShipyardLM.from_params`) is checked the same way.
   A call `f(a, b, key=...)` written after the name is checked against the def's signature: each
   identifier argument and each keyword must be a parameter (unless the def takes *args/**kwargs), and
   the positional count must lie between the required count and the maximum (self/cls not counted).
   A bare `f(args)` span is checked the same way when some shipyard module defines `f` at top level.
5. Config keys. A dotted name is also tried as a config key: from the root of the pydantic schema
   (`model.sliding_window`, `train.checkpoint.every`; Config.model_fields walked recursively through
   Optional / tuple / nested models; a dict-typed field such as `mesh.rules` accepts anything below),
   or, when it starts with the name of a nested section (`moe.bias_update_rate`, `lora.rank`), as the
   tail of a full key. `key=value` and `key: value` spans check the key.
   A dotted name is reported only when its first part is a known root (a config section, a shipyard
   module's name part, a shipyard class) and neither reading (code, config) holds; names whose last
   part is a file extension (`model.safetensors`, `config.json`), names that are part of a path or
   file name, and names whose first part is an installed third-party package (`peft.PeftModel`,
   `jax.distributed`) are skipped.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parents[1]

FILE_EXTS = {
    "py", "yaml", "yml", "json", "jsonl", "md", "toml", "txt", "npy", "png", "zst", "gz", "safetensors",
    "html", "parquet", "bin", "lock", "so", "csv", "sh", "cfg", "ini", "tmp", "log", "pt", "msgpack", "stablehlo",
}  # fmt: skip
CHECKED_PATH_EXTS = {"py", "yaml", "yml", "json", "jsonl", "md", "toml", "txt", "sh"}
SEPARATORS = {"&&", ";", "||", "$"}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"(?<![\w./<>*-])({IDENT}(?:\.{IDENT})+)(?![\w/-])(\([^()]*\))?")
FLAG = re.compile(r"(?:^|(?<=[\[(/|,=\s]))(--[A-Za-z0-9][A-Za-z0-9_-]*)")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*\.*|.*[<>{}].*|\.\.\.+.*|.*\.\.\.)$")


@dataclass
class Problem:
    file: str
    line: int
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: `{self.name}`: {self.why}"


@dataclass
class Chunk:
    """A piece of checkable text: an inline code span or one (joined) code-block line."""

    text: str
    line: int
    code: bool  # from a fenced block
    lang: str = ""
    paragraph: str = ""
    before: str = ""  # the prose just before an inline span


# --------------------------------------------------------------------------------------------- CLI help


@dataclass
class Help:
    subcommands: list[str]
    flags: set[str]
    overrides: bool


def parse_help(text: str) -> Help:
    """Subcommands and --flags from argparse help output (usage block and option lines)."""
    lines = text.splitlines()
    flags: set[str] = set()
    subs: list[str] = []
    section = "usage"
    usage: list[str] = []
    for line in lines:
        if not line.strip():
            section = "" if section == "usage" else section
            continue
        if not line.startswith(" ") and line.rstrip().endswith(":"):
            section = line.strip().rstrip(":").lower()
            continue
        if line.startswith("usage:") or section == "usage":
            section = "usage"
            usage.append(line)
            continue
        stripped = line.strip()
        if stripped.startswith("-"):
            # the invocation part ends at two spaces (then the help text)
            invocation = re.split(r"\s{2,}", stripped, maxsplit=1)[0]
            flags.update(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", invocation))
        elif "positional" in section and stripped.startswith("{") and not subs:
            subs = re.match(r"\{([^}]*)\}", stripped).group(1).split(",")
    usage_text = " ".join(usage)
    flags.update(re.findall(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_-]*", usage_text))
    overrides = bool(re.search(r"\boverrides\b", usage_text))
    return Help([s for s in subs if s], flags, overrides)


class CLI:
    """`shipyard PATH --help`, run as a subprocess once per command path."""

    def __init__(self, root: Path):
        exe = Path(sys.executable).with_name("shipyard")
        if not exe.exists() and shutil.which("shipyard"):
            exe = Path(shutil.which("shipyard"))
        self.argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "shipyard.cli"]
        self.env = {**os.environ, "SHIPYARD_NO_REEXEC": "1", "COLUMNS": "200"}
        self.root = root
        self.cache: dict[tuple[str, ...], Help | None] = {}

    def _run(self, path: tuple[str, ...]) -> Help | None:
        r = subprocess.run(
            [*self.argv, *path, "--help"],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.root,
            timeout=120,
        )
        if r.returncode != 0:
            return None
        return parse_help(r.stdout)

    def help(self, path: tuple[str, ...]) -> Help | None:
        if path not in self.cache:
            self.cache[path] = self._run(path)
        return self.cache[path]

    def flags(self, path: tuple[str, ...] = ()) -> set[str]:
        """The flags of `shipyard PATH` (none when its --help fails); of `()`, the global ones."""
        h = self.help(path)
        return h.flags if h is not None else set()

    def prefetch(self, paths: list[tuple[str, ...]]) -> None:
        todo = sorted({p for p in paths if p not in self.cache})
        with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 4) * 2)) as ex:
            for path, h in zip(todo, ex.map(self._run, todo), strict=True):
                self.cache[path] = h

    def tree(self, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """path and every command path below it, fetching level by level in parallel."""
        out, level = [], [path]
        while level:
            self.prefetch(level)
            out.extend(level)
            nxt = []
            for p in level:
                h = self.cache.get(p)
                if h:
                    nxt.extend((*p, s) for s in h.subcommands)
            level = nxt
        return out


# ------------------------------------------------------------------------------------- code index (ast)


@dataclass
class Def:
    params: list[str]  # positional parameters, in order (self/cls dropped for methods)
    required: int  # positional parameters without a default
    kwonly: list[str]
    kwonly_required: list[str]
    varargs: bool
    varkw: bool


def _def_of(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> Def:
    a = node.args
    pos = [p.arg for p in (*a.posonlyargs, *a.args)]
    required = len(pos) - len(a.defaults)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if method and not static and pos:
        pos, required = pos[1:], max(0, required - 1)
    kwonly = [p.arg for p in a.kwonlyargs]
    kwreq = [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    return Def(pos, required, kwonly, kwreq, a.vararg is not None, a.kwarg is not None)


@dataclass
class Scope:
    names: set[str] = field(default_factory=set)
    defs: dict[str, Def] = field(default_factory=dict)
    classes: dict[str, Scope] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)


def _scope(body: list[ast.stmt], method: bool = False) -> Scope:
    s = Scope()

    def visit(stmts):
        for n in stmts:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                s.names.add(n.name)
                s.defs[n.name] = _def_of(n, method)
            elif isinstance(n, ast.ClassDef):
                s.names.add(n.name)
                c = _scope(n.body, method=True)
                c.bases = [ast.unparse(b).split("[")[0] for b in n.bases]
                s.classes[n.name] = c
            elif isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    s.names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.Import | ast.ImportFrom):
                s.names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.If | ast.Try | ast.With | ast.For | ast.While):
                visit(n.body)
                visit(getattr(n, "orelse", []))
                visit(getattr(n, "finalbody", []))
                for h in getattr(n, "handlers", []):
                    visit(h.body)

    visit(body)
    return s


class Code:
    def __init__(self, src: Path):
        self.src = src  # the directory holding the shipyard package
        self.files: dict[str, Path] = {}
        for path in sorted((src / "shipyard").rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.files[".".join(parts)] = path
        self.roots = {part for m in self.files for part in m.split(".")}
        self._classes: dict[str, list[tuple[str, Scope]]] | None = None

    @functools.cache  # noqa: B019 (one Code per run)
    def scope(self, module: str) -> Scope | None:
        path = self.files.get(module)
        if path is None:
            return None
        try:
            return _scope(ast.parse(path.read_text()).body)
        except (SyntaxError, UnicodeDecodeError):
            return None

    def classes(self) -> dict[str, list[tuple[str, Scope]]]:
        if self._classes is None:
            self._classes = {}
            for m in self.files:
                for name, c in (self.scope(m) or Scope()).classes.items():
                    self._classes.setdefault(name, []).append((m, c))
        return self._classes

    def modules_named(self, parts: list[str]) -> list[str]:
        """Modules whose dotted name ends with these parts (`transformer`, `interop.hf`, `shipyard.plan`)."""
        tail = ".".join(parts)
        return [m for m in self.files if m == tail or m.endswith("." + tail)]

    def member(self, cls: Scope, name: str, seen: int = 0) -> tuple[bool, Def | None]:
        """(found or unknowable, its def) for Class.name, following bases defined in shipyard."""
        if name in cls.names:
            return True, cls.defs.get(name)
        for base in cls.bases:
            short = base.split(".")[-1]
            found = self.classes().get(short)
            if not found:
                return True, None  # a base from elsewhere may define it
            for _, b in found:
                if seen < 10:
                    ok, d = self.member(b, name, seen + 1)
                    if ok:
                        return ok, d
        return False, None

    def resolve_in(self, module: str, rest: list[str]) -> tuple[str | None, Def | None]:
        """(None, def) when module.rest exists, else (why not, None)."""
        scope = self.scope(module)
        if scope is None:
            return f"cannot parse {self.files[module].relative_to(self.src.parent)}", None
        if not rest:
            return None, None
        head = rest[0]
        where = self.files[module].relative_to(self.src.parent)
        if head not in scope.names:
            owners = [c for c, s in scope.classes.items() if head in s.names]
            if owners and len(rest) == 1:
                return None, scope.classes[owners[0]].defs.get(head)
            return f"{where} defines no `{head}`", None
        if len(rest) == 1:
            return None, scope.defs.get(head)
        if head in scope.classes:
            return self.resolve_class(scope.classes[head], head, rest[1:], where)
        return None, None  # an attribute of a value: not checked

    def resolve_class(self, cls: Scope, cname: str, rest: list[str], where) -> tuple[str | None, Def | None]:
        ok, d = self.member(cls, rest[0])
        if not ok:
            return f"class {cname} in {where} has no member `{rest[0]}`", None
        return None, d if len(rest) == 1 else None


def check_call(d: Def, name: str, args: str) -> str | None:
    """Why `name(args)` does not fit the signature, or None."""
    inner = args[1:-1].strip()
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    if any(p in ("...", "…") for p in parts):
        return None
    positional = [p for p in parts if not re.match(rf"^{IDENT}\s*=", p)]
    keywords = [p.split("=")[0].strip() for p in parts if re.match(rf"^{IDENT}\s*=", p)]
    every = set(d.params) | set(d.kwonly)
    sig = f"{name}({', '.join(d.params + (['*args'] if d.varargs else []) + d.kwonly)})"
    for k in keywords:
        if k not in every and not d.varkw:
            return f"no parameter `{k}` in {sig}"
    for p in positional:
        if re.fullmatch(IDENT, p) and p not in every and not (d.varargs or d.varkw):
            return f"no parameter `{p}` in {sig}"
    if len(positional) > len(d.params) and not d.varargs:
        return f"{len(positional)} positional arguments, {sig} takes at most {len(d.params)}"
    given = set(d.params[: len(positional)]) | set(keywords)
    missing = [p for p in d.params[: d.required] if p not in given] + [
        p for p in d.kwonly_required if p not in keywords
    ]
    if missing and not re.search(rf"{IDENT}\s*=\s*(,|$)", inner):  # `f(k=)` only names a parameter
        return f"{sig} also requires {', '.join(missing)}"
    return None


# --------------------------------------------------------------------------------------- config schema


def _models_in(annotation) -> list[type]:
    from pydantic import BaseModel

    out = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    for a in typing.get_args(annotation):
        out.extend(_models_in(a))
    return out


def _is_dict(annotation) -> bool:
    origin = typing.get_origin(annotation)
    return origin is dict or annotation is dict or any(_is_dict(a) for a in typing.get_args(annotation))


class Schema:
    """Every config key, dotted, from shipyard.config.Config."""

    def __init__(self, src: Path):
        sys.path.insert(0, str(src))
        from shipyard.config import Config

        self.keys: set[str] = set()
        self.open: set[str] = set()  # dict-typed keys: anything below is allowed
        self.sections: set[str] = set()

        def walk(model, prefix):
            for name, f in model.model_fields.items():
                key = f"{prefix}{name}"
                self.keys.add(key)
                if _is_dict(f.annotation):
                    self.open.add(key)
                for sub in _models_in(f.annotation):
                    if prefix:
                        self.sections.add(name)
                    walk(sub, key + ".")

        walk(Config, "")
        self.top = set(Config.model_fields)

    def check(self, key: str) -> str | None:
        parts = key.split(".")
        if parts[0] in self.top:
            candidates = [key]
        elif parts[0] in self.sections:
            candidates = [k for k in self.keys if k.endswith("." + key)] or [
                k for k in self.keys if k.endswith("." + parts[0])
            ]
            if any(k.endswith("." + key) for k in candidates):
                return None
            if not candidates:
                return f"no config section `{parts[0]}`"
            candidates = [c[: -len(parts[0])] + key for c in candidates]
        else:
            return f"no config key `{parts[0]}`"
        for cand in candidates:
            if cand in self.keys or any(cand.startswith(o + ".") for o in self.open):
                return None
        cand = candidates[0].split(".")
        for i in range(1, len(cand) + 1):
            if ".".join(cand[:i]) not in self.keys:
                parent = ".".join(cand[: i - 1]) or "Config"
                if any(parent == o for o in self.open):
                    return None
                return f"`{parent}` has no field `{cand[i - 1]}` (src/shipyard/config.py)"
        return None

    def check_value(self, key: str, value: str) -> str | None:
        """Keys of a YAML mapping value given to `key`."""
        try:
            import yaml

            data = yaml.safe_load(value)
        except Exception:
            return None
        if not isinstance(data, dict):
            return None

        def walk(prefix, d):
            for k, v in d.items():
                sub = f"{prefix}.{k}"
                why = self.check(sub)
                if why:
                    return sub, why
                if isinstance(v, dict):
                    r = walk(sub, v)
                    if r:
                        return r
            return None

        if any(key == o or key.startswith(o + ".") for o in self.open):
            return None
        r = walk(key, data)
        return f"{r[0]}: {r[1]}" if r else None


# ------------------------------------------------------------------------------------------- markdown


def chunks(text: str) -> list[Chunk]:
    out: list[Chunk] = []
    lines = text.splitlines()
    i = 0
    para: list[tuple[int, str]] = []

    def flush():
        if not para:
            return
        start = para[0][0]
        body = "\n".join(t for _, t in para)
        for m in SPAN.finditer(body):
            line = start + body.count("\n", 0, m.start())
            span = m.group(2).replace("\n", " ").replace("\\|", "|").strip()
            before = body[max(0, m.start() - 40) : m.start()].replace("\n", " ")
            out.append(Chunk(span, line, code=False, paragraph=body, before=before))
        para.clear()

    while i < len(lines):
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if fence:
            flush()
            mark, lang = fence.group(1), fence.group(2).lower()
            i += 1
            joined, start = "", None
            while i < len(lines) and not lines[i].strip().startswith(mark):
                if start is None:
                    start = i + 1
                line = lines[i]
                if line.rstrip().endswith("\\"):
                    joined += line.rstrip()[:-1] + " "
                else:
                    out.append(Chunk(joined + line, start, code=True, lang=lang))
                    joined, start = "", None
                i += 1
            if joined:
                out.append(Chunk(joined, start, code=True, lang=lang))
            i += 1
            continue
        if lines[i].strip():
            para.append((i + 1, lines[i]))
        else:
            flush()
        i += 1
    flush()
    return out


def strip_comment(s: str) -> str:
    out, quote = [], None
    for j, ch in enumerate(s):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'" and (j == 0 or not s[j - 1].isalnum()):
            quote = ch
        elif ch == "#" and (j == 0 or s[j - 1].isspace()):
            break
        out.append(ch)
    return "".join(out)


def tokens_of(s: str) -> list[str]:
    try:
        return shlex.split(s, posix=True)
    except ValueError:
        return s.split()


def command_segments(chunk: Chunk, word: str) -> list[list[str]]:
    """Token lists following each `word` at command position (`shipyard`, `make`)."""
    text = strip_comment(chunk.text) if chunk.code else chunk.text
    toks = tokens_of(text)
    segs = []
    for i, t in enumerate(toks):
        if (t == word or t.endswith("/" + word)) and (i == 0 or toks[i - 1] in SEPARATORS):
            seg = []
            for u in toks[i + 1 :]:
                if u in SEPARATORS:
                    break
                seg.append(u)
            segs.append(seg)
    return segs


# -------------------------------------------------------------------------------------------- checker


class Checker:
    def __init__(self, root: Path):
        self.root = root
        self.cli = CLI(root)
        self.documented: dict[tuple[str, ...], set[str]] = {}  # flags written after each command path
        self.code = Code(root / "src")
        self.schema = Schema(root / "src")
        self.makefile = root / "Makefile"
        mk = self.makefile.read_text() if self.makefile.exists() else ""
        self.targets = set(re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", mk, re.M))
        self.class_roots = set(self.code.classes())

    # -- commands

    def command_problems(self, chunk: Chunk, seg: list[str], mentioned: set[tuple[str, ...]]) -> list[str]:
        probs = []
        paths: list[tuple[str, ...]] = [()]
        resolved = True
        flags: list[tuple[list[tuple[str, ...]], str]] = []
        overrides: list[tuple[tuple[str, ...], str]] = []
        words = [t for t in seg if not t.startswith("-")]
        if words[:2] == ["plan", "data"]:  # cli/main.py's alias of `data plan`
            seg = ["data", "plan", *seg[seg.index("data") + 1 :]]
        for tok in seg:
            bare = tok.strip("[]()")
            if bare.startswith("-"):
                for f in FLAG.findall(bare):
                    if resolved:
                        flags.append((list(paths), f))
                continue
            if not resolved or not bare:
                continue
            helps = [self.cli.help(p) for p in paths]
            if any(h is None for h in helps):
                return [f"`shipyard {' '.join(paths[0])}` fails with --help"]
            subs = helps[0].subcommands
            if subs:
                alts = bare.split("|")
                if all(a in subs for a in alts):
                    paths = [(*p, a) for p in paths for a in alts]
                    mentioned.update(paths)
                    continue
                if PLACEHOLDER.match(bare) or not re.fullmatch(r"[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*", bare):
                    mentioned.update(paths)
                    resolved = False
                    continue
                bad = [a for a in alts if a not in subs]
                close = difflib.get_close_matches(bad[0], subs, n=1)
                has_flag = any(t.lstrip("[(").startswith("--") for t in seg)
                if chunk.code or has_flag or close:
                    hint = f" (did you mean `{close[0]}`?)" if close else ""
                    where = " ".join(("shipyard", *paths[0]))
                    probs.append(f"`{where}` has no subcommand `{bad[0]}`{hint}; it has: {', '.join(subs)}")
                return probs
            mentioned.update(paths)
            m = re.match(rf"^({IDENT}(?:\.{IDENT})+)=(.*)$", bare, re.S)
            if m and all(h.overrides for h in helps):
                overrides.append((paths[0], bare))
        mentioned.update(paths)
        for ps, f in flags:
            for p in ps:
                self.documented.setdefault(p, set()).add(f)
                h = self.cli.help(p)
                if h is not None and not h.subcommands and f not in h.flags and f != "--help":
                    if f in self.cli.flags():
                        continue  # global flag
                    close = difflib.get_close_matches(f, sorted(h.flags), n=1)
                    hint = f" (did you mean `{close[0]}`?)" if close else ""
                    probs.append(f"`shipyard {' '.join(p)}` has no flag `{f}`{hint}")
                elif h is not None and h.subcommands and f not in h.flags and f != "--help":
                    probs.append(f"`shipyard {' '.join(p)}` takes no flag `{f}` before its subcommand")
        for p, ov in overrides:
            key, value = ov.split("=", 1)
            why = self.schema.check(key) or self.schema.check_value(key, value)
            if why:
                probs.append(f"override `{key}` of `shipyard {' '.join(p)}`: {why}")
        return probs

    # -- code and config names

    def name_problem(self, name: str, call: str | None) -> str | None:
        parts = name.split(".")
        root = parts[0]
        if parts[-1].lower() in FILE_EXTS:
            return None
        in_config = root in self.schema.top or root in self.schema.sections
        in_code = root in self.code.roots or root in self.class_roots
        if not (in_config or in_code) or (_external(root) and root not in self.schema.top):
            return None
        why_config = self.schema.check(name) if in_config else None
        if in_config and why_config is None and not call:
            return None
        why_code = self.code_problem(parts, call) if in_code else None
        if in_code and why_code is None:
            return None
        if in_config and in_code:
            return f"neither a config key ({why_config}) nor code ({why_code})"
        return why_config or why_code

    def code_problem(self, parts: list[str], call: str | None) -> str | None:
        """None when parts (+ call) name existing code, else why not."""
        best = None
        if parts[0] in self.class_roots and len(parts) >= 2:
            for m, cls in self.code.classes()[parts[0]]:
                why, d = self.code.resolve_class(cls, parts[0], parts[1:], self.code.files[m].name)
                if why is None:
                    return check_call(d, ".".join(parts), call) if (d and call) else None
                best = best or why
        for k in range(len(parts), 0, -1):
            mods = self.code.modules_named(parts[:k])
            for m in mods:
                why, d = self.code.resolve_in(m, parts[k:])
                if why is None:
                    return check_call(d, ".".join(parts), call) if (d and call) else None
                best = best or why
            if mods:
                break
        return best or f"no shipyard module `{'.'.join(parts[:-1]) or parts[0]}`"

    def path_problem(self, tok: str, doc: Path) -> str | None:
        tok = tok.strip("()[],;:'\"`")
        if (
            not re.match(r"^[\w*]", tok)
            or re.search(r"[<>{}$=]|\.\.\.|…", tok)
            or tok.startswith(("http", "~", "-", ".venv"))
        ):
            return None
        ext = tok.rsplit(".", 1)[-1].lower() if "." in tok.rsplit("/", 1)[-1] else ""
        if ext not in CHECKED_PATH_EXTS or not re.fullmatch(r"[\w./*-]+", tok):
            return None
        bases = [self.root, self.root / "src" / "shipyard", self.root / "src", doc.parent]
        if ext != "py":
            first = tok.split("/")[0]
            if "/" not in tok or not any((b / first).is_dir() for b in bases[:3]) or first in (".", ".."):
                return None
        for b in bases:
            if "*" in tok:
                if list(b.glob(tok)):
                    return None
            elif (b / tok).exists():
                return None
        return "no such file (looked in the repository root, src/shipyard/, src/ and next to the doc)"

    def check_file(self, path: Path, display: str) -> list[Problem]:
        return self.check_text(path.read_text(), path, display)

    def check_docstrings(self, path: Path, display: str) -> list[Problem]:
        """The docstrings of one source file (module, classes, functions), read as markdown: the same
        checks as a doc page, with line numbers in the source file. A bare `--flag` there must be a
        flag of some shipyard command (a docstring rarely names the command in a span of its own)."""
        probs: list[Problem] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
                continue
            if not isinstance(body[0].value.value, str):
                continue
            text = body[0].value.value
            for prob in self.check_text(text, path, display, any_command_flags=True):
                prob.line += body[0].lineno - 1
                probs.append(prob)
        return sorted(probs, key=lambda p: p.line)

    def check_text(
        self, text: str, path: Path, display: str, any_command_flags: bool = False
    ) -> list[Problem]:
        probs: list[Problem] = []
        cs = chunks(text)
        mentioned: set[tuple[str, ...]] = set()
        segs = [(c, s) for c in cs for s in command_segments(c, "shipyard") if s]
        # fetch the help of every command path named, a level at a time, in parallel
        level = [()]
        while level:
            self.cli.prefetch(level)
            nxt = []
            for p in level:
                h = self.cli.cache.get(p)
                for _, s in segs:
                    if h and len(s) > len(p) and tuple(x.strip("[]()") for x in s[: len(p)]) == p:
                        for a in s[len(p)].strip("[]()").split("|"):
                            if a in h.subcommands:
                                nxt.append((*p, a))
            level = sorted(set(nxt))
        command_chunks = set()
        for c, s in segs:
            command_chunks.add(id(c))
            for why in self.command_problems(c, s, mentioned):
                probs.append(Problem(display, c.line, "shipyard " + " ".join(s)[:60], why))
        for c in cs:
            for s in command_segments(c, "make"):
                if s and re.fullmatch(r"[A-Za-z0-9][\w.-]*", s[0]) and s[0] not in self.targets:
                    close = difflib.get_close_matches(s[0], sorted(self.targets), n=1)
                    hint = f" (did you mean `make {close[0]}`?)" if close else ""
                    probs.append(
                        Problem(display, c.line, f"make {s[0]}", f"no such target in Makefile{hint}")
                    )
            for tok in (strip_comment(c.text) if c.code else c.text).split():
                why = self.path_problem(tok, path)
                if why:
                    probs.append(Problem(display, c.line, tok.strip("()[],;:'\"`"), why))
            if c.code or id(c) in command_chunks or re.match(r"^(\S*/)?(python|make)\b", c.text):
                continue
            probs.extend(self.span_problems(c, display, mentioned))
        # bare flags, against the commands this file names (a docstring: any shipyard command)
        flag_paths = {()}
        for p in mentioned:
            flag_paths.update(self.cli.tree(p))
        if any_command_flags and any(c.text.startswith("--") and not c.code for c in cs):
            flag_paths.update(self.cli.tree(()))
            mentioned = {*mentioned, ()}
        known_flags = set().union(*[self.cli.flags(p) for p in flag_paths])
        for c in cs:
            if c.code or not c.text.startswith("--"):
                continue
            f = FLAG.findall(c.text.split()[0])
            if not f or "_" in f[0] or re.search(r"lm[-_]eval", c.paragraph):
                continue
            if f[0] not in known_flags:
                names = ", ".join(sorted("shipyard " + " ".join(p) for p in mentioned if p)) or "shipyard"
                probs.append(
                    Problem(display, c.line, f[0], f"not a flag of the commands this file names ({names})")
                )
        return sorted(probs, key=lambda p: p.line)

    def span_problems(self, c: Chunk, display: str, mentioned) -> list[Problem]:
        text = c.text
        probs = []
        m = re.fullmatch(r"([\w/]+\.py)\s*:\s*(" + IDENT + r"(?:\." + IDENT + r")*)\s*(\([^()]*\))?.*", text)
        m2 = re.fullmatch(r"([\w]+(?:/[\w]+)+)\.(" + IDENT + r"(?:\." + IDENT + r")*)\s*(\([^()]*\))?", text)
        m3 = re.fullmatch(r"(" + IDENT + r"(?:\." + IDENT + r")*):(" + IDENT + r")\s*(\([^()]*\))?", text)
        if m2 and m2.group(2).split(".")[-1].lower() in FILE_EXTS:
            m2 = None  # a file name, checked as a path
        if m or m2 or m3:
            mm = m or m2 or m3
            if m3:
                mods = self.code.modules_named(mm.group(1).split("."))
            else:
                mod_path = mm.group(1).removesuffix(".py")
                mods = self.code.modules_named(mod_path.split("/"))
            if not mods:
                if m:  # another Python file of the repository (tests/, bench/, tools/): its top level
                    why = _top_level_problem(self.root / mm.group(1), mm.group(2).split(".")[0])
                    return [Problem(display, c.line, text, why)] if why else []
                return []  # not a module of shipyard: a missing .py file is reported as a path
            whys = []
            for mod in mods:
                why, d = self.code.resolve_in(mod, mm.group(2).split("."))
                if why is None and d and mm.group(3):
                    why = check_call(d, mm.group(2), mm.group(3))
                if why is None:
                    return []
                whys.append(why)
            return [Problem(display, c.line, text, whys[0])]
        bare = re.fullmatch(rf"({IDENT})(\([^()]*\))", text)
        if bare:
            defs = []
            for mod in self.code.files:
                s = self.code.scope(mod)
                if s and bare.group(1) in s.defs:
                    defs.append(s.defs[bare.group(1)])
            whys = [check_call(d, bare.group(1), bare.group(2)) for d in defs]
            if defs and all(whys):
                probs.append(Problem(display, c.line, text, whys[0]))
            return probs
        key = re.match(rf"^({IDENT}(?:\.{IDENT})+)\s*(=|:\s)(.*)$", text)
        if key:
            why = self.schema.check(key.group(1)) if key.group(1).split(".")[0] in self.schema.top else None
            why = why or (
                self.schema.check_value(key.group(1), key.group(3)) if key.group(2) == "=" else None
            )
            if why is None and key.group(1).split(".")[0] not in self.schema.top:
                why = self.name_problem(key.group(1), None)
            return [Problem(display, c.line, key.group(1), why)] if why else []
        owner = re.search(r"([\w-]+)'s?\s*$", c.before)
        if owner and _external(owner.group(1)):
            return []  # `model.generate` after "transformers'" is that library's
        for dm in DOTTED.finditer(text):
            why = self.name_problem(dm.group(1), dm.group(2))
            if why:
                probs.append(Problem(display, c.line, dm.group(0), why))
        return probs


@functools.cache
def _top_level_names(path: Path) -> frozenset[str] | None:
    """Names a Python file defines at its top level (def, class, assignment, import), or None."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _top_level_problem(path: Path, name: str) -> str | None:
    """Why `path.py: name` names nothing (a repository file outside the package, e.g. a test)."""
    names = _top_level_names(path)
    if names is None:
        return None  # a missing file is reported as a path
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=1)
    return f"{path.name} defines no `{name}`" + (f" (did you mean `{close[0]}`?)" if close else "")


@functools.cache
def _external(root: str) -> bool:
    """An importable top-level package other than shipyard (jax, peft, optax, ...)."""
    if root == "shipyard":
        return False
    try:
        return importlib.util.find_spec(root) is not None
    except (ImportError, ValueError):
        return False


def undocumented_flags(checker: Checker, cli_md: Path, display: str) -> list[Problem]:
    """Every flag of every command must be in docs/cli.md: written after its command in an invocation
    (`shipyard serve ... --fixed-shape`), or as a span on a line that names the command. Run after
    `check_file(cli_md)`, which records the invocations."""
    lines = cli_md.read_text().splitlines()
    global_flags = checker.cli.flags()
    probs = []
    for path in checker.cli.tree(()):
        h = checker.cli.help(path)
        if not path or h is None:  # a group's own flags count too (`plan` is a command and a group)
            continue
        name = "shipyard " + " ".join(path)
        seen = checker.documented.get(path, set())
        on_its_lines = {
            f for line in lines if name + " " in line or line.endswith(name) for f in FLAG.findall(line)
        }
        for f in sorted(h.flags - global_flags - {"--help"} - seen - on_its_lines):
            probs.append(
                Problem(display, 1, f"{name} {f}", "a flag of the command that docs/cli.md does not name")
            )
    return probs


TEST_REF = re.compile(r"`(tests/test_\w+\.py): (\w+)`( \(slow\b)?")


def _marked_slow(node) -> bool:
    """Whether an expression (a decorator, a `pytestmark` value) names `pytest.mark.slow`."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


@functools.cache
def _slow_tests(path: Path) -> dict[str, bool] | None:
    """{test function: marked slow} of a test module (a module-level `pytestmark` with `slow` marks
    every test; else the function's own decorators), read with ast; None if it cannot be parsed."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    whole = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _marked_slow(node.value)
        for node in tree.body
    )
    return {
        node.name: whole or any(_marked_slow(d) for d in node.decorator_list)
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def tier_problems(root: Path, testing_md: Path, display: str) -> list[Problem]:
    """docs/testing.md writes `(slow)` right after each test of the second tier (`make test-slow`) and
    nothing after one of `make test`'s: a test moved between the tiers must move its annotation, or
    the table tells a reader that `make test` checks a claim it does not."""
    probs = []
    for number, line in enumerate(testing_md.read_text().splitlines(), 1):
        for m in TEST_REF.finditer(line):
            tests = _slow_tests(root / m.group(1))
            if tests is None or m.group(2) not in tests:
                continue  # a missing file or test is the code-reference check's to report
            slow, said = tests[m.group(2)], m.group(3) is not None
            if slow != said:
                why = (
                    "marked slow, so it runs in `make test-slow`: write (slow) after it"
                    if slow
                    else ("not marked slow (it runs in `make test`), yet the row says (slow)")
                )
                probs.append(Problem(display, number, f"{m.group(1)}: {m.group(2)}", why))
    return probs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    ap.add_argument("--repo", type=Path, default=DEFAULT_ROOT, help="repository root (default: this one)")
    args = ap.parse_args(argv)
    root = args.repo.resolve()
    files = args.files or [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    sources = [] if args.files else sorted((root / "src" / "shipyard").rglob("*.py"))
    checker = Checker(root)
    problems: list[Problem] = []
    for f in sources:
        problems.extend(checker.check_docstrings(f, str(f.relative_to(root))))
    for f in files:
        f = f if f.is_absolute() else (Path.cwd() / f)
        try:
            display = str(f.resolve().relative_to(root))
        except ValueError:
            display = str(f)
        checker.documented = {}  # what docs/cli.md itself writes after each command
        problems.extend(checker.check_file(f, display))
        if display == "docs/cli.md" and not args.files:
            problems.extend(undocumented_flags(checker, f, display))
        if display == "docs/testing.md":
            problems.extend(tier_problems(root, f, display))
    for p in problems:
        print(p)
    sys.stdout.flush()
    if problems:
        print(f"check_docs: {len(problems)} problem(s) in {len(files)} file(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
