"""A Hugging Face model directory as users download one: a transformers Llama with random weights, a
real byte-level BPE tokenizer (trained here with `tokenizers`), a ChatML chat template that injects a
default system prompt, and a generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2-style ChatML: a default system message when the conversation has none.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# a small GQA Llama, untied (so export writes lm_head and the tensor comparison covers it)
SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
SHAPE["tie_word_embeddings"] = False


def corpus(n: int = 200) -> list[str]:
    words = [
        "the",
        "model",
        "reads",
        "a",
        "token",
        "and",
        "writes",
        "the",
        "next",
        "one",
        "upper",
        "lower",
        "value",
        "parse",
        "def",
        "return",
    ]
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12 + i % 9)) for i in range(n)]


def write_bpe(out: Path, vocab_size: int = 320) -> Path:
    """tokenizer.json (byte-level BPE with merges) + tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def write_hf_model(out: Path, seed: int = 0, max_positions: int = 128):
    """The whole directory; returns (transformers model, tokenizers.Tokenizer)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    write_bpe(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    torch.manual_seed(seed)
    ids = dict(eos_token_id=end, pad_token_id=tok.token_to_id("<|endoftext|>"))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), max_position_embeddings=max_positions, **SHAPE, **ids
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random init is near zero; larger weights make greedy text depend on the model
        for p in model.parameters():
            p.mul_(4.0 if p.ndim > 1 else 1.0)
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=[end], do_sample=False)
    model.save_pretrained(out)
    return model, tok


def tokenized_shards(root: Path, documents: int, shard_tokens: int) -> Path:
    """root/shards: `documents` corpus texts through the real tokenize stage with a BPE tokenizer."""
    from shipyard.data.configs import ReadConfig, TokenizeConfig
    from shipyard.data.tokenize import run_tokenize

    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(documents)))
    tok = write_bpe(root / "tok")
    run_tokenize(
        [str(docs)], root / "shards", tok, TokenizeConfig(shard_tokens=shard_tokens), ReadConfig(), workers=1
    )
    return root / "shards"
