"""shipyard generate and chat: complete prompts, talk to a chat-tuned model."""

from __future__ import annotations

from shipyard.cli.args import add_model_dir, add_quantize_flags, add_sampling_flags, add_template_flag
from shipyard.errors import ConfigError


def _sampling(args, gen, defaults, stop_ids=()):
    """The command's Sampling: each flag, else the model's generation_config.json, else `defaults`
    (`inference.sampling.resolve_sampling`, the rule serve follows too)."""
    from shipyard.inference.sampling import resolve_sampling

    return resolve_sampling(
        defaults,
        gen,
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=stop_ids,
    )


def _check_context(prompts: list[list[int]], max_new_tokens: int, context: int, what: str) -> None:
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise ConfigError(
            f"{what}: a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} exceeds the model's "
            f"context of {context} tokens (model.max_seq_len); shorten the prompt or ask for fewer tokens"
        )


def _cmd_generate(args) -> int:
    from shipyard.inference.artifact import is_artifact

    if is_artifact(args.run_dir):  # `shipyard export stablehlo` output: its own programs, no model built
        return _generate_from_artifact(args)
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.inference.engine import engine_for
    from shipyard.inference.sampling import GENERATE
    from shipyard.model.quantize import maybe_quantize
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(args.run_dir, "generate", args.tokenizer)
    tok_dir = model_dir.require_tokenizer("generate")  # before the params are read
    gen = model_dir.generation("generate")
    tok = load_tokenizer(tok_dir)
    eos = special_token_ids(tok_dir, tok)["eos_token"]
    stop_ids = tuple(dict.fromkeys(i for i in (eos, *gen.eos_ids) if i is not None))
    prompts = [tok.encode(p, add_special_tokens=False).ids or [eos] for p in args.prompt]
    _check_context(prompts, args.max_new_tokens, model_dir.config.model.max_seq_len, "generate")
    cfg, step, params = model_dir.load(args.step, what="generate")
    params = maybe_quantize(params, cfg.model, args.quantize)

    def decode(tokens: list[int]) -> str:
        return tok.decode(tokens, skip_special_tokens=False)

    engine = engine_for(params, cfg.model, prompts, args.max_new_tokens, kv_dtype=args.kv_dtype)
    sampling = _sampling(args, gen, GENERATE, stop_ids)
    outs = [list(c.tokens) for c in engine.generate(prompts, sampling, stop=_text_stop(decode, args.stop))]
    _print_completions(args.prompt, outs, decode, stop_ids, args.stop)
    return 0


def _text_stop(decode, stops: list[str]):
    """The `stop` callback of `--stop TEXT`: a row ends once its decoded text holds one of them."""

    def stop(tokens: list[int]) -> bool:
        return bool(stops) and any(s in decode(tokens) for s in stops)

    return stop


def _print_completions(prompts: list[str], outs: list[list[int]], decode, stop_ids, stops: list[str]) -> None:
    """Each prompt and its completion (stop ids dropped, cut before the first --stop text)."""
    for prompt, out in zip(prompts, outs):
        text = decode([t for t in out if t not in stop_ids])
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        print(f"--- {prompt!r}\n{prompt}{text}")


def _generate_from_artifact(args) -> int:
    """`shipyard generate OUT` on a StableHLO artifact: the same flags and output as on a model, run by
    the artifact's programs (`inference.artifact`, which never imports the model code)."""
    from types import SimpleNamespace

    from shipyard.inference.artifact import Artifact
    from shipyard.inference.sampling import GENERATE

    for flag in ("step", "tokenizer", "quantize", "kv_dtype"):  # chosen at export, fixed in the artifact
        if getattr(args, flag, None) is not None:
            raise ConfigError(
                f"generate: --{flag.replace('_', '-')} does not apply to {args.run_dir}, a StableHLO "
                "artifact (it holds one set of weights, its cache and its own tokenizer; choose them when exporting)"
            )
    art = Artifact(args.run_dir, "generate")
    prompts = [art.encode(p) for p in args.prompt]
    # the model's generation_config.json settings, recorded at export
    gen = SimpleNamespace(**art.manifest["sampling"])
    s = _sampling(args, gen, GENERATE)
    outs = art.generate(
        prompts,
        s.max_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        stop_ids=art.stop_ids,
        stop=_text_stop(art.decode_text, args.stop),
    )
    _print_completions(args.prompt, outs, art.decode_text, art.stop_ids, args.stop)
    return 0


def _cmd_chat(args) -> int:
    from shipyard.inference.chat import load_chat_model, run_chat
    from shipyard.inference.sampling import CHAT
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(args.run_dir, "chat", args.tokenizer)
    gen = model_dir.generation("chat")
    model = load_chat_model(  # one conversation: one cache row
        model_dir, args.step, args.template, quantize=args.quantize, kv_dtype=args.kv_dtype, max_batch=1
    )
    return run_chat(model, _sampling(args, gen, CHAT), system=args.system)


def _described(d) -> tuple[str, str, str]:
    """How the --temperature / --top-k / --top-p help texts name an entry point's defaults."""
    return (
        f"{d.temperature:g}" + (" (greedy)" if d.temperature == 0 else ""),
        f"{d.top_k}" if d.top_k else "all tokens",
        f"{d.top_p:g}",
    )


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    from shipyard.inference.sampling import CHAT, GENERATE  # (no JAX: the defaults only)

    ge = sub.add_parser("generate", help="complete prompts with a model (KV cache, batched)")
    add_model_dir(ge)
    ge.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    add_sampling_flags(ge, GENERATE.max_tokens, _described(GENERATE))
    ge.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    add_quantize_flags(ge)
    ge.set_defaults(func=_cmd_generate)

    ch = sub.add_parser("chat", help="talk to a chat model in the terminal (streamed replies)")
    add_model_dir(ch)
    ch.add_argument("--system", default=None, help="system message for the conversation")
    add_sampling_flags(ch, CHAT.max_tokens, _described(CHAT))
    add_template_flag(ch, "chat template (default: the one the run trained with)")
    add_quantize_flags(ch)
    ch.set_defaults(func=_cmd_chat)
