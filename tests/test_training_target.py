"""Fast checks of the demo-target training code and of the committed demo checkpoint.

No corpus build here (that scans the stdlib): the tokenizer is trained on a few KB of
text, the model is a tiny Qwen3 built from config.
"""

from __future__ import annotations

import json
import random
import re
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from demo.corpus_code import collect_defs
from demo.corpus_math import format_math, math_problem
from demo.target_data import WindowSampler
from demo.target_model import lr_at, make_model, window_loss
from demo.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    render_chat,
    save_tokenizer,
    train_tokenizer,
)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "checkpoints" / "demo-target"

SAMPLE_TEXTS = [
    'def add(a, b):\n    """Return a + b."""\n    return a + b\n',
    "class Foo:\n    def __init__(self, x=12345):\n        self.x = x  # note\n",
    "Question: What is 48 + 27?\nAnswer: 48 + 27 = 75. The answer is 75.",
    render_chat(
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
        ]
    ),
    "Unicode: café, naïve, 数学, emoji \U0001f600, tabs\tand\r\nCRLF",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    texts = SAMPLE_TEXTS * 20 + [format_math(*math_problem(random.Random(i))) for i in range(200)]
    tok = train_tokenizer(texts, vocab_size=400)
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, out)
    return tok, out


def test_tokenizer_round_trip_and_specials(tiny_tokenizer):
    tok, _ = tiny_tokenizer
    assert [tok.token_to_id(s) for s in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    for text in SAMPLE_TEXTS + ["never seen: ∑ xyz 0.5e-3 {'k': [1, 2]}\n\n    indented"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode(f"{IM_START}user\nhello{IM_END}", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2
    # Digits are single tokens (the Qwen split), which the arithmetic data relies on.
    assert len(tok.encode("12345", add_special_tokens=False).ids) == 5


def test_autotokenizer_chat_template(tiny_tokenizer):
    from transformers import AutoTokenizer

    _, path = tiny_tokenizer
    hf = AutoTokenizer.from_pretrained(str(path))
    assert hf.chat_template == CHAT_TEMPLATE
    assert hf.eos_token == IM_END and hf.pad_token == ENDOFTEXT
    for msgs in (
        [{"role": "user", "content": "What is 2 + 3?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        for gen in (False, True):
            text = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert text == render_chat(msgs, add_generation_prompt=gen)
    text = hf.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith(f"{IM_START}assistant\n")
    s = SAMPLE_TEXTS[0]
    assert hf.decode(hf(s)["input_ids"]) == s


def test_math_generator_is_deterministic_and_correct():
    a = [math_problem(random.Random(7)) for _ in range(3)]
    b = [math_problem(random.Random(7)) for _ in range(3)]
    assert a == b
    rng = random.Random(0)
    for _ in range(500):
        q, ans = math_problem(rng)
        assert re.search(r"The answer is (x = )?\d+\.$", ans), ans
        # Every chain "expr = expr = ..." in the worked solution is true arithmetic.
        for m in re.finditer(r"[\d(][\d\s+\-*/()]*(?:=[\d\s+\-*/()]+)+", ans):
            values = [eval(side) for side in m.group().split("=")]  # digits and operators only
            assert all(v == values[0] for v in values), (m.group(), ans)


def test_docstring_extraction():
    src = (
        'def public(a, b=1):\n    """Add things.\n\n    More text."""\n    return a + b\n\n'
        'def _private():\n    """Hidden."""\n'
    )
    defs = collect_defs(src, "mod")
    assert [(d.qualname, d.kind, d.args, d.doc) for d in defs] == [
        ("public", "function", "a, b=1", "Add things.")
    ]
    assert defs[0].header.startswith("def public") and defs[0].body.strip() == "return a + b"


def _tiny_args(**kw):
    base = dict(
        hidden=32,
        intermediate=64,
        layers=2,
        heads=2,
        kv_heads=1,
        head_dim=16,
        max_positions=128,
        seed=0,
        lr=1e-2,
        warmup=3,
        steps=30,
        min_lr_ratio=0.1,
    )
    base.update(kw)
    return Namespace(**base)


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    args = _tiny_args()
    model = make_model(64, args)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
    streams = {
        "code": torch.arange(2000, dtype=torch.int32) % 17 + 3,
        "math": (torch.arange(2000, dtype=torch.int32) * 7) % 29 + 3,
    }
    sampler = WindowSampler(streams, {"code": 0.5, "math": 0.5}, seq_len=24, seed=1)
    x, names = sampler.sample(8)
    assert x.shape == (8, 25) and set(names) <= {"code", "math"}
    # The sampler is seeded.
    x2, names2 = WindowSampler(streams, {"code": 0.5, "math": 0.5}, seq_len=24, seed=1).sample(8)
    assert torch.equal(x, x2) and names == names2
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = window_loss(model, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert lr_at(0, args) < lr_at(2, args) <= args.lr and lr_at(args.steps, args) == pytest.approx(
        args.lr * 0.1
    )


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="no committed demo checkpoint")
def test_committed_demo_checkpoint_loads():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    cfg = AutoConfig.from_pretrained(str(DEMO))
    assert isinstance(cfg, Qwen3Config) and cfg.model_type == "qwen3"
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads < cfg.num_attention_heads
    size = sum(p.stat().st_size for p in DEMO.iterdir() if p.is_file())
    assert size <= 30 * 2**20, size
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    assert tok.chat_template and len(tok) == cfg.vocab_size
    model = AutoModelForCausalLM.from_pretrained(str(DEMO))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
    # It learned its domains: low loss on held-out math answers.
    prompts = [
        json.loads(line)
        for line in (REPO / "demo" / "data" / "dev_prompts.jsonl").read_text().splitlines()
    ]
    assert {p["domain"] for p in prompts} == {"code", "math", "chat"}
    p = next(p for p in prompts if p["domain"] == "math")
    ids = tok(p["prompt"] + p["reference"])["input_ids"]
    n_prompt = len(tok(p["prompt"])["input_ids"])
    assert ids[:n_prompt] == tok(p["prompt"])["input_ids"]  # prompts end on a token boundary
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    loss = torch.nn.functional.cross_entropy(
        logits[n_prompt - 1 : -1], torch.tensor(ids[n_prompt:])
    )
    assert loss.item() < 1.5, loss.item()
