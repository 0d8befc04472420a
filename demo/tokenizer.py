"""Byte-level BPE tokenizer for the demo target, with Qwen special tokens and chat template.

The tokenizer is trained with the ``tokenizers`` library on the local corpus
(``demo.corpus``) and saved as ``tokenizer.json`` + ``tokenizer_config.json`` so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it and ``apply_chat_template``
works. Pre-tokenization uses the Qwen2/Qwen3 split pattern (digits one at a time, which
helps arithmetic) followed by the GPT-2 byte-level mapping, so every string round-trips.

Special tokens (ids fixed, in this order, before the learned vocabulary):
``<|endoftext|>`` = 0 (document separator, pad), ``<|im_start|>`` = 1, ``<|im_end|>`` = 2
(end of a chat turn, the chat eos).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

DEFAULT_SYSTEM = "You are a helpful assistant."

# Qwen2.5-style ChatML template: a default system turn when none is given, each message
# as <|im_start|>role\ncontent<|im_end|>\n, and "<|im_start|>assistant\n" as the
# generation prompt. ``render_chat`` below is the same thing in Python (the corpus uses it
# to render training dialogues; a test checks both agree).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# The Qwen2 / Qwen3 pre-tokenizer split pattern.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Python rendering of CHAT_TEMPLATE (identical output)."""
    out = []
    if not messages or messages[0]["role"] != "system":
        out.append(f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n")
    for m in messages:
        out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def build_empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 6144, min_frequency: int = 2
) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (deterministic for a given input order)."""
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config(model_max_length: int = 2048) -> dict:
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": IM_END,
                "pad_token": ENDOFTEXT,
                "additional_special_tokens": [IM_START, IM_END],
            },
            indent=2,
        )
        + "\n"
    )
    # transformers >= 4.43 also reads a standalone template file; keep both in sync.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
