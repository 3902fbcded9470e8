"""Typed configs of the data stages (extract, filter, dedup, decontaminate, classifier, tokenizer, tokenize, prepare).

Each stage reads its section from a YAML file (`--config`) and `--set key=value`
overrides on the command line; `data prepare` reads them all from one file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from shipyard.config import Schema, apply_overrides, format_validation_error, read_yaml
from shipyard.errors import ConfigError

DEFAULT_SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)


class ReadConfig(Schema):
    """How documents are read from the inputs."""

    text_field: str = "text"
    """Field (jsonl) or column (parquet) holding the text."""
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    """Fail the stage when more than this fraction of records is bad (corrupt, not UTF-8, no text field)."""


class ExtractConfig(Schema):
    """HTML to text with resiliparse."""

    main_content: bool = True
    """Keep only the main content (drops navigation, headers, footers, sidebars) rather than all visible text."""
    alt_texts: bool = False
    """Include image alt texts."""
    links: bool = False
    """Include link targets."""
    list_bullets: bool = True
    """Render list items with bullets."""
    min_chars: int = Field(1, ge=0)
    """Drop documents whose extracted text has fewer characters (counted as empty_after_extraction)."""
    drop_page_chrome: bool = True
    """Before extraction, remove what the page marks as chrome: <nav>, role=navigation/search/contentinfo, aria-hidden="true", hidden, and <footer> outside an article/section/main (also applies with main_content off)."""
    strip_anchor_ids: bool = True
    """Before extraction, remove the ids of sections, headings and blocks whose id is their heading's slug: they come from heading text, and main_content drops blocks whose id reads like boilerplate (the Python docs lost "New Features Related to Type Hints")."""
    keep_notes: bool = True
    """Keep <aside> notes and footnotes (role note / doc-footnote / doc-endnotes, or an aside holding only those) as text: main_content drops every <aside>, which took all 121 footnotes of the Python docs."""
    keep_text_figures: bool = True
    """Keep <figure>s that hold a <pre>, <table> or <blockquote> as text: with alt_texts off resiliparse skips every <figure> as an image, and the Rust book (mdBook) puts its code listings in one."""
    list_link_fraction: float | None = Field(0.5, ge=0, le=1)
    """Lists with at most this fraction of link text are prose citing names: their links become plain text before main_content runs, which drops lists above about 20% link text as menus. Null turns this off."""
    table_rows: bool = True
    """Write each data table as one line per row, cells joined by table_separator (resiliparse alone gives every cell its own paragraph); tables holding tables (layout) and tables that are mostly link text (indexes) are left to resiliparse."""
    table_separator: str = Field(" | ", min_length=1, pattern=r"^[^\n]*$")
    """Between the cells of a row when table_rows is on."""


class FilterConfig(Schema):
    """Heuristic quality rules (Gopher / C4 style); each is counted separately. Null disables a rule."""

    profile: Literal["prose", "code", "auto"] = "auto"
    """prose applies every rule; code skips the rules that would throw out source code (word shape, alphabetic fraction, symbols, terminal punctuation) and uses the code_* limits; auto picks code for documents whose source ends in one of code_extensions."""
    code_extensions: tuple[str, ...] = (
        ".py",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".sh",
    )
    """With profile auto: source-file suffixes that mark a document as code."""
    min_words: int | None = Field(50, ge=0)
    """Drop documents with fewer words (whitespace-separated tokens)."""
    max_words: int | None = Field(100_000, gt=0)
    """Drop documents with more words."""
    min_chars: int | None = Field(None, ge=0)
    """Drop documents with fewer characters."""
    min_mean_word_length: float | None = Field(3.0, ge=0)
    """prose: drop documents whose mean word length is below this."""
    max_mean_word_length: float | None = Field(10.0, gt=0)
    """prose: drop documents whose mean word length is above this."""
    min_alpha_word_fraction: float | None = Field(0.8, ge=0, le=1)
    """prose: drop documents where fewer than this fraction of words contain a letter."""
    max_symbol_word_ratio: float | None = Field(0.1, ge=0)
    """prose: drop documents with more '#' and '...' per word than this."""
    max_duplicate_line_fraction: float | None = Field(0.3, ge=0, le=1)
    """Drop documents where more than this fraction of non-empty lines are repeats of an earlier line."""
    max_top_ngram_fraction: float | None = Field(0.2, ge=0, le=1)
    """Drop documents where the most frequent word 2-gram covers more than this fraction of characters."""
    max_duplicate_ngram_fraction: float | None = Field(0.15, ge=0, le=1)
    """Drop documents where characters inside repeated word 5-grams exceed this fraction."""
    min_terminal_punct_line_fraction: float | None = Field(None, ge=0, le=1)
    """prose (C4): drop documents where fewer than this fraction of lines end in . ! ? or a quote; off by default."""
    code_max_duplicate_line_fraction: float | None = Field(0.5, ge=0, le=1)
    """code profile's duplicate-line limit (code repeats lines like `return None` legitimately)."""
    code_max_top_ngram_fraction: float | None = Field(0.4, ge=0, le=1)
    """code profile's top 2-gram limit."""
    code_max_duplicate_ngram_fraction: float | None = Field(0.6, ge=0, le=1)
    """code profile's repeated 5-gram limit (the prose default would drop a third of the stdlib)."""


class DedupConfig(Schema):
    """Exact and fuzzy (MinHash + LSH) deduplication; each cluster keeps its first document in input order."""

    exact: bool = True
    """Drop documents whose normalised text (lowercased, whitespace collapsed) equals an earlier one's."""
    fuzzy: bool = True
    """Drop near-duplicates found by MinHash + LSH."""
    shingle_size: int = Field(5, gt=0)
    """Words per shingle (words are lowercased runs of letters and digits)."""
    num_perm: int = Field(128, gt=0)
    """MinHash permutations (signature length)."""
    bands: int = Field(16, gt=0)
    """LSH bands; two documents become candidates when any band matches."""
    rows: int = Field(8, gt=0)
    """Signature rows per band (bands * rows must not exceed num_perm)."""
    threshold: float = Field(0.8, gt=0, le=1)
    """Candidates are duplicates when their estimated Jaccard similarity is at least this."""
    seed: int = 1
    """Seed of the MinHash hash functions."""
    max_examples: int = Field(20, ge=0)
    """Removed pairs recorded in stats.json as examples."""

    @model_validator(mode="after")
    def _check_bands(self) -> DedupConfig:
        if self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands: bands * rows = {self.bands * self.rows} exceeds num_perm={self.num_perm}"
            )
        return self


class DecontaminateConfig(Schema):
    """Remove training documents that share an n-gram with evaluation data."""

    eval_sets: tuple[str, ...] = ()
    """Evaluation data files or directories (any readable document format); each is reported separately."""
    ngram: int = Field(13, gt=0)
    """Words per n-gram (lowercased runs of letters and digits); 13 as in GPT-3's decontamination."""
    mode: Literal["drop", "report"] = "drop"
    """drop removes contaminated documents; report only counts them."""
    max_examples: int = Field(20, ge=0)
    """Contaminated documents recorded in stats.json as examples (with the matching n-gram)."""


class ClassifierTrainConfig(Schema):
    """A fastText quality classifier (DCLM / Marin style): positive vs. negative documents."""

    lr: float = Field(0.1, gt=0)
    """Learning rate (fastText `lr`)."""
    epoch: int = Field(50, gt=0)
    """Passes over the training documents."""
    word_ngrams: int = Field(2, ge=1)
    """Longest word n-gram used as a feature (fastText `wordNgrams`); 2 sees word order, 1 does not."""
    dim: int = Field(32, gt=0)
    """Embedding size."""
    min_count: int = Field(1, ge=1)
    """Words seen fewer times than this in the training documents are ignored."""
    bucket: int = Field(200_000, gt=0)
    """Hash buckets for word n-grams; the model file holds (words + bucket) x dim floats."""
    max_tokens: int | None = Field(2_000, gt=0)
    """Use only a document's first this many tokens (training and scoring alike); null uses all."""
    seed: int = 0
    """Seed of the held-out split, the order of training lines and fastText's own sampling."""
    held_out_fraction: float = Field(0.1, ge=0, lt=1)
    """Fraction of each class kept out of training and scored for report.json."""
    threads: int = Field(1, ge=1)
    """Training threads; only 1 is deterministic (fastText's threads race on the shared weights)."""


class ClassifyConfig(Schema):
    """Score documents with a trained quality classifier and keep the best."""

    threshold: float | None = Field(None, ge=0, le=1)
    """Keep documents whose score is at least this; with neither this nor top_fraction, 0.5."""
    top_fraction: float | None = Field(None, gt=0, le=1)
    """Keep this fraction of all documents, the highest scores (ties broken by input order)."""
    score_field: str = "quality_score"
    """Record field that receives the score (the probability of the positive class)."""
    histogram_bins: int = Field(20, gt=0, le=1000)
    """Equal-width score bins over [0, 1] in stats.json and the PNG."""
    example_levels: int = Field(5, gt=0, le=100)
    """Score levels (equal-width bands over [0, 1]) that get an example document in stats.json."""

    @model_validator(mode="after")
    def _one_rule(self) -> ClassifyConfig:
        if self.threshold is not None and self.top_fraction is not None:
            raise ValueError("threshold: give threshold or top_fraction, not both")
        return self


class TokenizerTrainConfig(Schema):
    """Train a byte-level BPE tokenizer with the `tokenizers` library."""

    vocab_size: int = Field(8192, ge=256 + 1)
    """Vocabulary size including the 256 byte tokens and the special tokens."""
    min_frequency: int = Field(2, ge=1)
    """Merges must occur at least this often in the sample."""
    special_tokens: tuple[str, ...] = DEFAULT_SPECIAL_TOKENS
    """Special tokens, ids 0.. in this order; must include bos_token and eos_token (and pad_token when set)."""
    bos_token: str = "<|bos|>"
    """Beginning-of-sequence token."""
    eos_token: str = "<|eos|>"
    """End-of-document token; separates documents in token shards."""
    pad_token: str | None = "<|pad|>"
    """Padding token, or null for none."""
    sample_bytes: int | None = Field(200_000_000, gt=0)
    """Train on at most this many bytes of text: documents in input order (after sample_fraction) until the next would exceed it; null uses all. Combine with sample_fraction to spread the sample over a large corpus."""
    sample_fraction: float = Field(1.0, gt=0, le=1)
    """Keep each document with this probability (decided by a hash of its id, so the sample is reproducible)."""

    @model_validator(mode="after")
    def _check_specials(self) -> TokenizerTrainConfig:
        for name in ("bos_token", "eos_token", "pad_token"):
            tok = getattr(self, name)
            if tok is not None and tok not in self.special_tokens:
                raise ValueError(f"{name}: {tok!r} is not one of special_tokens {list(self.special_tokens)}")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ValueError("special_tokens: contains duplicates")
        return self


class TokenizeConfig(Schema):
    """Encode documents into token shards (documents separated by EOS)."""

    shard_tokens: int = Field(100_000_000, gt=0)
    """Start a new shard after this many tokens (a document is never split across shards)."""
    add_bos: bool = False
    """Also put BOS before each document."""
    batch_documents: int = Field(256, gt=0)
    """Documents per work item sent to a worker process."""


class PrepareConfig(Schema):
    """The whole chain of `shipyard data prepare`: stages run in order, each into <out>/<stage>."""

    inputs: tuple[str, ...] = Field(min_length=1)
    """Training documents: files or directories (paths relative to the config file's directory)."""
    validation_inputs: tuple[str, ...] = ()
    """Held-out documents, tokenized with the same tokenizer (extracted when HTML; not filtered or deduplicated)."""
    out: str
    """Output directory (relative to the config file's directory)."""
    workers: int | None = Field(None, gt=0)
    """Worker processes; null uses every core."""
    ray: str | None = None
    """A Ray cluster's address (host:port, or `local` to start one here) whose tasks run every stage's
    work units instead of local worker processes (same outputs); null runs them here."""
    read: ReadConfig = ReadConfig()
    """Reading."""
    extract: ExtractConfig | None = None
    """HTML extraction; null skips the stage (inputs are already text)."""
    filter: FilterConfig | None = FilterConfig()
    """Quality filters; null skips the stage."""
    dedup: DedupConfig | None = DedupConfig()
    """Deduplication; null skips the stage."""
    decontaminate: DecontaminateConfig | None = None
    """Decontamination against evaluation sets; null skips the stage."""
    tokenizer_path: str | None = None
    """Use this existing tokenizer.json (file or directory) instead of training one."""
    tokenizer: TokenizerTrainConfig = TokenizerTrainConfig()
    """Tokenizer training (ignored when tokenizer_path is set)."""
    tokenize: TokenizeConfig = TokenizeConfig()
    """Tokenization."""


def build_schema(schema: type[Schema], data: dict, where: str):
    """Validate `data` against `schema`; one line naming each bad field on failure."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            f"{where}: " + format_validation_error(e, root=schema).removeprefix("invalid config: ")
        ) from e


def load_stage_config(schema: type[Schema], config: str | Path | None, sets: list[str], where: str):
    """A stage's config from an optional YAML file plus `key=value` overrides."""
    data: dict = {}
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"{where}: config file {path} does not exist")
        data = read_yaml(path.read_text(), f"config file {path}")
    return build_schema(schema, apply_overrides(data, list(sets)), where)


def load_prepare_config(path: str | Path, sets: list[str] = ()) -> PrepareConfig:
    """A `data prepare` config; relative paths in it are resolved against the file's directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data prepare: config file {path} does not exist")
    data = apply_overrides(read_yaml(path.read_text(), f"config file {path}"), list(sets))
    base = path.resolve().parent

    def resolve(p):
        if not isinstance(p, str) or "://" in p or Path(p).is_absolute():  # URLs are never relative
            return p
        return os.path.normpath(base / p)

    for key in ("inputs", "validation_inputs"):
        if isinstance(data.get(key), list):
            data[key] = [resolve(p) for p in data[key]]
    for key in ("out", "tokenizer_path"):
        if isinstance(data.get(key), str):
            data[key] = resolve(data[key])
    dc = data.get("decontaminate")
    if isinstance(dc, dict) and isinstance(dc.get("eval_sets"), list):
        dc["eval_sets"] = [resolve(p) for p in dc["eval_sets"]]
    return build_schema(PrepareConfig, data, f"data prepare {path}")
