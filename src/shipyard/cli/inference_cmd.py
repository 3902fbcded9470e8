"""shipyard generate and chat: complete prompts, talk to a chat-tuned model."""

from __future__ import annotations

from pathlib import Path


def _cmd_generate(args) -> int:
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.inference.generate import Generator
    from shipyard.runs import open_model_dir

    model_dir = open_model_dir(args.run_dir, "generate")
    tok_dir = model_dir.require_tokenizer("generate")  # before the params are read
    cfg, step, params = model_dir.load(args.step, what="generate")
    tok = load_tokenizer(tok_dir)
    eos = special_token_ids(tok_dir, tok)["eos_token"]
    prompts = [tok.encode(p, add_special_tokens=False).ids or [eos] for p in args.prompt]

    def stop(tokens: list[int]) -> bool:
        return bool(args.stop) and any(s in tok.decode(tokens, skip_special_tokens=False) for s in args.stop)

    outs = Generator(params, cfg.model)(
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=(eos,),
        stop=stop,
    )
    for prompt, out in zip(args.prompt, outs):
        text = tok.decode([t for t in out if t != eos], skip_special_tokens=False)
        for s in args.stop:
            if s in text:
                text = text[: text.index(s)]
        print(f"--- {prompt!r}\n{prompt}{text}")
    return 0


def _cmd_chat(args) -> int:
    from shipyard.inference.chat import load_chat_model, run_chat

    model = load_chat_model(args.run_dir, args.step, args.template)
    return run_chat(
        model,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    ge = sub.add_parser("generate", help="complete prompts with a trained run (KV cache, batched)")
    ge.add_argument("run_dir", type=Path, help="run directory (its newest checkpoint unless --step)")
    ge.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    ge.add_argument("--max-new-tokens", type=int, default=64)
    ge.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ge.add_argument("--top-k", type=int, default=None)
    ge.add_argument("--top-p", type=float, default=None)
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    ge.add_argument("--step", type=int, default=None, help="checkpoint step")
    ge.set_defaults(func=_cmd_generate)

    ch = sub.add_parser("chat", help="talk to a chat-tuned run in the terminal (streamed replies)")
    ch.add_argument("run_dir", type=Path, help="run directory (its newest checkpoint unless --step)")
    ch.add_argument("--system", default=None, help="system message for the conversation")
    ch.add_argument("--max-new-tokens", type=int, default=256)
    ch.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ch.add_argument("--top-k", type=int, default=50)
    ch.add_argument("--top-p", type=float, default=0.95)
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument(
        "--template",
        choices=["auto", "shipyard", "chatml", "llama3"],
        default=None,
        help="chat template (default: the one the run trained with)",
    )
    ch.add_argument("--step", type=int, default=None, help="checkpoint step")
    ch.set_defaults(func=_cmd_chat)
