"""EleutherAI lm-evaluation-harness adapter: evaluate a shipyard run directory on any lm-eval task.

    python -m shipyard.lm_eval_adapter --model shipyard --model_args checkpoint=RUN_DIR --tasks hellaswag

takes exactly `lm_eval`'s command-line arguments. Model arguments:
`checkpoint` (a run directory, required), `step` (default: the newest
checkpoint), `batch_size` (rows per forward pass; wins over lm-eval's
`--batch_size`, whose default is 1; "auto" means 16),
`max_length` (default and maximum: the model's `max_seq_len`), `max_gen_toks`
(default 256, for tasks that do not set it), `tokenizer` (a tokenizer.json or
its directory; default: the one next to the run's training shards) and `seed`
(for tasks that sample).

Why `python -m shipyard.lm_eval_adapter` and not the bare `lm_eval` command:
lm-eval (0.4.x, checked against 0.4.13) finds models only in its own registry,
which it fills from its own `lm_eval.models` table; it reads no entry-point
group and imports no third-party module, and the model is built before
`--include_path` task files are read. A model name from another package is
known only once that package has called `register_model` in the same process,
which is what this module does on import and then runs lm-eval's own CLI. In
Python: `import shipyard.lm_eval_adapter`, then
`lm_eval.simple_evaluate(model="shipyard", model_args={"checkpoint": ...})`.

Request handling:

- `loglikelihood`: context and continuation are encoded *together* and split at
  the character boundary using the tokenizer's offsets: tokens that end inside
  the context are the context, the rest (including a token straddling the
  boundary, when a BPE merge crosses it) are scored as the continuation. The
  scored sequence is then exactly the tokenizer's encoding of
  context + continuation, which encoding the two separately is not when a
  merge crosses the boundary (and lm-eval's default of encoding the whole and
  the context and slicing can drop or repeat characters then). With the
  byte-level BPE shipyard trains (the GPT-2 pre-tokenizer splits before a
  space), a continuation starting with a space splits exactly where separate
  encoding would, so scores equal `shipyard eval`'s. An empty context is the
  document-start token (BOS when the training shards were written with
  `add_bos`, else EOS, which ends every training document).
- Sequences longer than `max_length` + 1 tokens lose tokens from the left
  (the continuation is kept whole when it fits); `is_greedy` is true when
  every continuation token is the argmax at its position. Requests are sorted
  by length and scored `batch_size` at a time by `shipyard.eval.loglik.loglikelihoods`.
- `loglikelihood_rolling`: the text's tokens after the document-start token,
  cut into disjoint windows of `max_length` predictions, each window with as
  much preceding context as fits (lm-eval's rolling-window definition); every
  token is predicted once.
- `generate_until`: shipyard's continuous-batching `Engine` (every request
  of a gen_kwargs group submitted at once, `batch_size` decoded together),
  greedy unless the task sets `do_sample` with a temperature; stops at
  EOS, at any `until` string (the text is cut before it), or after
  `max_gen_toks` tokens; the prompt keeps its last `max_length - max_gen_toks`
  tokens.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # lm-eval is an optional extra
    raise ImportError(
        "shipyard.lm_eval_adapter needs lm-evaluation-harness: pip install 'shipyard[lm-eval]' "
        "(or pip install 'lm-eval>=0.4')"
    ) from e

from shipyard.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16
_GEN_KEYS = {"until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p"}


class ShipyardLM(TemplateLM):
    """A shipyard checkpoint as an lm-eval language model (single process, JAX on the local devices)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        step: int | None = None,
        batch_size: int | str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        tokenizer: str | None = None,
        seed: int = 0,
        **ignored,
    ):
        super().__init__()
        from shipyard.run.model_dir import open_model_dir

        if checkpoint is None:
            raise ConfigError("lm-eval --model shipyard: give --model_args checkpoint=RUN_DIR")
        for key, value in ignored.items():
            if value is not None and key not in ("device", "max_batch_size"):
                log.warning("shipyard lm-eval model: ignoring unknown argument %s=%r", key, value)
        model_dir = open_model_dir(checkpoint, "lm-eval")
        cfg, step, params = model_dir.load(step, what="lm-eval")
        tok_dir = Path(tokenizer) if tokenizer is not None else model_dir.tokenizer()
        if tok_dir is None:
            raise DataError(
                f"lm-eval: no tokenizer.json next to the training data of {checkpoint}; "
                "give --model_args tokenizer=PATH"
            )
        self._setup(params, cfg.model, tok_dir, batch_size, max_length, max_gen_toks, seed)
        self.run_dir, self.step = Path(checkpoint), step

    @classmethod
    def from_params(
        cls,
        params,
        model_cfg,
        tokenizer: str | Path,
        *,
        batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
        engine=None,
    ) -> ShipyardLM:
        """The model around params already in memory (e.g. during training); `tokenizer` is a
        tokenizer.json or its directory. Pass it to `lm_eval.simple_evaluate(model=...)`. `engine`: an
        `inference.engine.Engine` over the same params for generate_until to share (e.g. a server's)."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._setup(params, model_cfg, Path(tokenizer), batch_size, max_length, max_gen_toks, seed)
        self._engine = engine
        self.run_dir, self.step = None, None
        return self

    def _setup(self, params, model_cfg, tok_dir: Path, batch_size, max_length, max_gen_toks, seed) -> None:
        import jax
        import jax.numpy as jnp

        from shipyard.data.tokenizer import load_tokenizer, special_token_ids

        self.cfg = model_cfg
        self.params = jax.tree.map(jnp.asarray, params)
        self.tokenizer_path = tok_dir
        self.tok = load_tokenizer(tok_dir)
        ids = special_token_ids(tok_dir, self.tok)
        self._eos = ids["eos_token"]
        with_bos = ids["bos_token"] is not None and _shards_start_with_bos(tok_dir)
        self._prefix = ids["bos_token"] if with_bos else self._eos
        self.batch_size = _batch_size(batch_size)
        self._max_length = self.cfg.max_seq_len if max_length is None else int(max_length)
        if not 1 <= self._max_length <= self.cfg.max_seq_len:
            raise ConfigError(
                f"lm-eval --model_args max_length={max_length}: expected 1..{self.cfg.max_seq_len} "
                "(the model's max_seq_len)"
            )
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        self._engine = None

    # -------------------------------------------------------------------- construction from lm-eval

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # --model_args win over lm-eval's own flags (it always passes --batch_size, default 1)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    # -------------------------------------------------------------------- tokenizer

    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer_path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=False)

    def split_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens): the encoding of context + continuation, cut where the
        context's characters end (a token straddling that point belongs to the continuation)."""
        if not context:
            return [self._prefix], self.tok_encode(continuation)
        enc = self.tok.encode(context + continuation, add_special_tokens=False)
        cut = len(context)
        k = 0
        while k < len(enc.ids) and enc.offsets[k][1] <= cut:
            k += 1
        return (enc.ids[:k] or [self._prefix]), enc.ids[k:]

    # -------------------------------------------------------------------- scoring

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        reqs = [((ctx, cont), *self.split_pair(ctx, cont)) for ctx, cont in (r.args for r in requests)]
        return self._loglikelihood_tokens(reqs, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        from shipyard.eval.loglik import loglikelihoods

        limit = self.max_length + 1
        pairs = []
        for _, ctx, cont in requests:
            # at most max_length + 1 tokens, cut from the left; the continuation is scored where it fits
            whole = [*ctx, *cont][-limit:]
            n = min(len(cont), len(whole) - 1)
            pairs.append((whole[: len(whole) - n], whole[len(whole) - n :]))
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="shipyard loglikelihood", disable=disable_tqdm or not batches):
            scores = loglikelihoods(self.params, self.cfg, [pairs[i] for i in batch], batch=self.batch_size)
            for i, score in zip(batch, scores):
                results[i] = score
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return results

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, predicted) windows over [prefix] + tokens: each token predicted once, windows of
        max_length predictions, each with max_length - 1 ... tokens of context before it."""
        L, n = self.max_length, len(tokens)
        seq = [self._prefix, *tokens]  # seq[j + 1] == tokens[j]
        windows, start = [], 0
        while start < n:
            end = min(start + L, n)
            lo = max(0, end - L)  # the model sees seq[lo:end] and predicts tokens[start:end]
            windows.append((seq[lo : start + 1], tokens[start:end]))
            start = end
        return windows

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, reqs = [], []
        for k, (text,) in enumerate(r.args for r in requests):
            for ctx, cont in self.rolling_windows(self.tok_encode(text)):
                owners.append(k)
                reqs.append((None, ctx, cont))
        scores = self._loglikelihood_tokens(reqs, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owners, scores):
            totals[k] += ll
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # -------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = [text for text, _ in self.completions(requests, disable_tqdm=disable_tqdm)]
        for r, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", r.args, text)
        return out

    def completions(self, requests, *, logprobs: bool = False, disable_tqdm: bool = True) -> list[tuple]:
        """(text, `inference.engine.Completion`) per generate_until request: the text is what
        generate_until answers (EOS dropped, cut before the first `until` string). Requests with the
        same gen_kwargs go to the engine together, which decodes `batch_size` of them at a time."""
        from tqdm import tqdm

        from shipyard.inference.sampling import GENERATE, resolve_sampling

        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out: list[tuple | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="shipyard generate_until", disable=disable_tqdm)
        for members in groups.values():
            until, max_new, settings = self._generation_settings(dict(requests[members[0]].args[1] or {}))
            # the task's settings, else greedy: lm-eval's gen_kwargs are the whole recipe (a model's
            # generation_config.json would make scores depend on who exported it)
            sampling = resolve_sampling(
                GENERATE,
                max_tokens=max_new,
                seed=self.seed,
                stop_ids=(self._eos,),
                logprobs=logprobs,
                **settings,
            )
            prompts = [
                (self.tok_encode(requests[i].args[0]) or [self._prefix])[-(self.max_length - max_new) :]
                for i in members
            ]

            def stop(tokens: list[int], until=until) -> bool:
                return bool(until) and any(s in self.tok_decode(tokens) for s in until)

            for i, done in zip(members, self.engine().generate(prompts, sampling, stop=stop)):
                text = self.tok_decode([t for t in done.tokens if t != self._eos])
                cuts = [text.find(s) for s in until if s and s in text]
                out[i] = (text[: min(cuts)] if cuts else text, done)
            bar.update(len(members))
        bar.close()
        return out

    def engine(self):
        """The `inference.engine.Engine` generate_until runs on: `batch_size` rows over `max_length`
        slots, built at first use unless one was given (`from_params(..., engine=)`)."""
        if self._engine is None:
            from shipyard.inference.engine import Engine

            self._engine = Engine(self.params, self.cfg, max_batch=self.batch_size, max_len=self.max_length)
        return self._engine

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int, dict]:
        """(stop strings, new-token budget, sampling settings the task sets) from its gen_kwargs."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks)))
        if max_new >= self.max_length:
            log.warning(
                "shipyard lm-eval model: max_gen_toks=%d does not fit max_length=%d; generating %d tokens",
                max_new,
                self.max_length,
                self.max_length - 1,
            )
            max_new = self.max_length - 1
        temperature = float(kwargs.get("temperature") or 0.0)
        sampling = {"temperature": 0.0}
        if kwargs.get("do_sample") and temperature > 0:
            sampling = {
                "temperature": temperature,
                "top_k": kwargs.get("top_k"),
                "top_p": kwargs.get("top_p"),
            }
        unknown = set(kwargs) - _GEN_KEYS
        if unknown:
            log.warning("shipyard lm-eval model: ignoring generation settings %s", sorted(unknown))
        return until, max(max_new, 1), sampling

    def get_model_info(self) -> dict:
        run = None if self.run_dir is None else str(self.run_dir)
        return {"checkpoint": run, "step": self.step, "max_length": self.max_length}


def _batch_size(value) -> int:
    """lm-eval's batch size: an int, or "auto"/"auto:N" (no memory probing here: the default)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"lm-eval batch_size={value!r}: expected a positive integer") from e
    if size < 1:
        raise ConfigError(f"lm-eval batch_size={value!r}: expected a positive integer")
    return size


def _shards_start_with_bos(tok_dir: Path) -> bool:
    """Whether the token shards next to this tokenizer were written with a BOS before every document."""
    manifest = tok_dir / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        return bool(json.loads(manifest.read_text()).get("add_bos"))
    except (json.JSONDecodeError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line, with the `shipyard` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    # Run as a script this file is `__main__`; the model is registered by the module under its real
    # name, once (registering both copies would be a name clash in lm-eval's registry).
    from shipyard.eval.lm_eval import main as _main

    _main()
else:
    register_model("shipyard")(ShipyardLM)
