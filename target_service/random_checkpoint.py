"""Tiny Qwen3 checkpoints with random weights, for tests, benchmarks and `flashmap up`.

`make_random_qwen3(path)` writes a Hugging Face checkpoint directory (config.json,
model.safetensors, and optionally a byte-level BPE tokenizer with a chat template)
that both transformers and target_service load. Nothing is downloaded: the weights
come from a seeded generator and the tokenizer is trained on the text below. The chat
template is ChatML, or Qwen3's own (chat_template="qwen3": thinking and tools, with Qwen3's
think and tool-call tokens as added tokens). A `script` of (token, next token) pairs makes the
model a bigram model whose greedy continuation follows it (`script_next_tokens`), so a test
can have a tiny model think, answer and call a tool.

Initialisation: transformers' default std of 0.02 makes the logits of a 64-wide
model nearly uniform (top-1 probability close to 1/V), so the top-2 gap at
temperature 0 is often within float rounding and greedy-equality tests flake.
The default here is std = 2.5 / sqrt(hidden_size), which puts the logits' std near
2.5: peaked like a language model yet far from one-hot, so top-k / top-p also have
something to cut. RMSNorm
gains are drawn around 1 (not all ones) so that a forward that ignores a gain
cannot pass a comparison with transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's added tokens that are not special (decoded text keeps them).
QWEN3_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN3_CHAT_TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
EOS_TOKEN = "<|im_end|>"  # chat turns end here; <|endoftext|> also stops (config eos list)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Training text for the tokenizer: fixed, so the same vocabulary comes out every time.
TOKENIZER_TEXT = """\
The river runs past the old mill and under the stone bridge before it reaches the sea.
In the morning the fishermen push their boats into the water, and in the evening they
come back with nets full of silver fish. The children wait on the bridge and count the
boats as they return: one, two, three, four, five, six, seven, eight, nine, ten.
A speculative decoder guesses several tokens at once and a larger model checks the guess
in a single pass. When the guess is right, many tokens are produced for the price of one;
when it is wrong, the larger model supplies the correct token and the work continues.
The output is exactly what the larger model would have written on its own.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue on a clear day.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
The weather today will be sunny in the north and cloudy in the south, with a light wind
from the west. Tomorrow there may be rain in the mountains and snow on the highest peaks.
New York and San Diego are two cities in the United States; one is on the east coast and
the other is on the west coast. Many people travel between them every day by plane.
She opened the door, looked at the garden, and smiled: the roses had finally bloomed.
He wrote a letter to his brother, folded it twice, and put it in the blue envelope.
The numbers 12, 24, 36, 48 and 60 are all multiples of twelve; 7, 11 and 13 are prime.
User: Please write a short poem about the moon.
Assistant: The moon is bright, the night is long, the quiet stars repeat their song.
User: Thank you! Can you explain what a transformer is?
Assistant: A transformer is a neural network that reads a sequence of tokens and uses
attention to decide which earlier tokens matter for the next one.
"""


def default_init_std(hidden_size: int) -> float:
    return 2.5 / math.sqrt(hidden_size)


def make_random_qwen3(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    seed: int = 0,
    init_std: float | None = None,
    with_tokenizer: bool = True,
    chat_template: str = "chatml",
    added_tokens: list[str] = (),
    script: list[tuple[str, str]] = (),
) -> Path:
    """Write a random-weight Qwen3ForCausalLM checkpoint to `path`; return the path.

    init_std None means default_init_std(hidden_size) (see the module docstring).
    The global torch RNG is left untouched. With a tokenizer, eos ids are
    [<|im_end|>, <|endoftext|>]; without one, eos is the last vocabulary id.
    chat_template: "chatml" or "qwen3" (Qwen3's template and its think / tool-call tokens).
    added_tokens: more texts that are one token each. script: (text, next text) pairs, each
    text one token: after the first the model's argmax is the second (script_next_tokens).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM  # slow import: only when used

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if chat_template not in ("chatml", "qwen3"):
        raise ValueError(f"chat_template must be chatml or qwen3, got {chat_template!r}")
    tokenizer = (
        _make_tokenizer(vocab_size, chat_template, list(added_tokens)) if with_tokenizer else None
    )
    if tokenizer is not None:
        eos = [
            tokenizer.convert_tokens_to_ids(EOS_TOKEN),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ]
    else:
        eos = [vocab_size - 1]
    std = default_init_std(hidden_size) if init_std is None else float(init_std)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        initializer_range=std,
        eos_token_id=eos,
        # No pad_token_id: HF would zero that embedding row, and weights would then
        # depend on with_tokenizer. The tokenizer still declares its pad token.
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
            if script:
                script_next_tokens(
                    model, [(_one_token(tokenizer, a), _one_token(tokenizer, b)) for a, b in script]
                )
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def script_next_tokens(model, pairs: list[tuple[int, int]], boost: float = 25.0) -> None:
    """Make `model` a bigram model whose argmax after token a is b, for each (a, b) of pairs:
    every layer's attention and MLP outputs are zeroed, so the last hidden state is the final
    norm of the current token's embedding, and the LM head gains the least-squares change
    that adds `boost` to b's logit at a's state and nothing at the other pairs' states (the
    random logits' spread is far below boost). Other tokens keep random continuations."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    a = torch.tensor([p[0] for p in pairs])
    states = model.model.norm(model.model.embed_tokens.weight[a])  # [n, H]
    target = torch.zeros(len(pairs), model.lm_head.weight.shape[0])  # [n, V]
    target[torch.arange(len(pairs)), torch.tensor([p[1] for p in pairs])] = boost
    model.lm_head.weight += (torch.linalg.pinv(states) @ target).T  # [V, H]


def _one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"script: {text!r} is {len(ids)} tokens, not one (add it to added_tokens)")
    return ids[0]


def _make_tokenizer(vocab_size: int, chat_template: str = "chatml", added: list[str] = ()):
    """A byte-level BPE tokenizer with at most vocab_size entries, as a transformers tokenizer,
    with the chat template and the added tokens asked for."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_base = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
    if vocab_size < n_base:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= {n_base})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    qwen3 = chat_template == "qwen3"
    extra = (QWEN3_TOKENS if qwen3 else []) + list(added)
    if extra:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2],
        chat_template=QWEN3_CHAT_TEMPLATE.read_text() if qwen3 else CHAT_TEMPLATE,
    )
