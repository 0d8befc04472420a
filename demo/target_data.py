"""The demo target's data: the corpus (demo.corpus) and its held-out prompts, the
byte-level BPE trained on it (demo.tokenizer), one token stream per domain (documents
separated by <|endoftext|>), and the windows that training and evaluation read from them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from demo.corpus import (
    DATA,
    DOMAINS,
    Corpus,
    build_corpus,
    write_prompt_splits,
)
from demo.tokenizer import ENDOFTEXT, load_tokenizer, save_tokenizer, train_tokenizer

# Share of the tokenizer's training text (--tokenizer-chars) per domain.
TOKENIZER_BUDGET = {"code": 0.5, "math": 0.2, "chat": 0.3}


def tokenize_stream(tok, docs: list[str], eot_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int32)


@dataclass
class Streams:
    train: dict[str, torch.Tensor]
    heldout: dict[str, torch.Tensor]


class WindowSampler:
    """Random windows of seq_len+1 tokens; each row's domain is drawn from the mix."""

    def __init__(
        self, streams: dict[str, torch.Tensor], mix: dict[str, float], seq_len: int, seed: int
    ):
        self.names = [n for n in DOMAINS if mix.get(n, 0) > 0]
        self.streams = streams
        self.weights = torch.tensor([mix[n] for n in self.names], dtype=torch.float64)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, batch: int) -> tuple[torch.Tensor, list[str]]:
        dom = torch.multinomial(self.weights, batch, replacement=True, generator=self.gen).tolist()
        rows, names = [], []
        for d in dom:
            s = self.streams[self.names[d]]
            start = int(torch.randint(0, len(s) - self.seq_len - 1, (1,), generator=self.gen))
            rows.append(s[start : start + self.seq_len + 1])
            names.append(self.names[d])
        return torch.stack(rows).long(), names


def fixed_windows(stream: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n evaluation windows: evenly spaced when the stream is long enough, else seeded."""
    span = seq_len + 1
    if len(stream) >= n * span:
        step = len(stream) // n
        starts = [i * step for i in range(n)]
    else:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, max(1, len(stream) - span), (n,), generator=g).tolist()
    return torch.stack([stream[s : s + span] for s in starts]).long()


def save_state(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@dataclass
class TargetData:
    corpus: Corpus
    stats: dict  # corpus.stats(): documents and characters per domain
    tok: object  # tokenizers.Tokenizer
    tok_sha: str  # of tokenizer.json
    streams: Streams
    tok_stats: dict  # per domain: train / held-out tokens, characters per token


def prepare_data(args, out: Path, state_dir: Path, resume: bool, log) -> TargetData:
    """Corpus and held-out prompts, the tokenizer (reused from `out` when resuming), and the
    token streams (cached in `state_dir` by corpus and tokenizer)."""
    t0 = time.time()
    corpus = build_corpus(args.seed, scale=args.corpus_scale)
    folder = Path(args.prompts_out or DATA)
    prompts_path, _ = write_prompt_splits(
        corpus, folder / "dev_prompts.jsonl", folder / "test_prompts.jsonl"
    )
    stats = corpus.stats()
    log(
        f"corpus {corpus.fingerprint()} from {corpus.stdlib} in {time.time() - t0:.1f}s: "
        f"{json.dumps(stats)}"
    )
    log(f"held-out prompts -> {prompts_path}")

    t0 = time.time()
    if resume and (out / "tokenizer.json").is_file():
        tok = load_tokenizer(out)
        log("tokenizer: reusing the one in the output directory")
    else:
        texts: list[str] = []
        for name in DOMAINS:
            n = 0
            for d in corpus.domains[name].train:
                if n >= args.tokenizer_chars * TOKENIZER_BUDGET[name]:
                    break
                texts.append(d)
                n += len(d)
        tok = train_tokenizer(texts, vocab_size=args.vocab_size)
        save_tokenizer(tok, out, model_max_length=args.max_positions)
    tok_sha = file_sha(out / "tokenizer.json")
    eot = tok.token_to_id(ENDOFTEXT)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, sha {tok_sha}, {time.time() - t0:.1f}s")

    t0 = time.time()
    cache = state_dir / f"tokens-{corpus.fingerprint()}-{tok_sha}.pt"
    if cache.is_file():
        streams = Streams(**torch.load(cache, weights_only=True))
    else:
        streams = Streams(
            train={n: tokenize_stream(tok, corpus.domains[n].train, eot) for n in DOMAINS},
            heldout={n: tokenize_stream(tok, corpus.domains[n].heldout, eot) for n in DOMAINS},
        )
        save_state(cache, {"train": streams.train, "heldout": streams.heldout})
    tok_stats = {
        n: {
            "train_tokens": len(streams.train[n]),
            "heldout_tokens": len(streams.heldout[n]),
            "chars_per_token": round(stats[n]["train_chars"] / max(1, len(streams.train[n])), 2),
        }
        for n in DOMAINS
    }
    log(f"tokens: {json.dumps(tok_stats)} ({time.time() - t0:.1f}s)")
    return TargetData(corpus, stats, tok, tok_sha, streams, tok_stats)
