"""Token data for drafter training: prompts -> the target's own responses, token ids only.

The trainer computes the target's features online (training.online_features), so what is
stored is prompt + response ids: 8 bytes a token, against 40 KB a token for Qwen3-8B's
features offline. Same shard layout as training.drafter_data (tokens, offsets,
prompt_lens; no features), meta.json with format "flashmap-token-data".

Prompts: a JSONL file (one {"prompt": text} / {"prompt_ids": [...]} / {"messages": [...]}
per line), or a Hugging Face dataset (`--dataset NAME`, when the `datasets` package is
installed; a text column or a conversation column, the conversation cut before its last
assistant turn). `--chat` renders text prompts as one user message through the target's
chat template.

Responses: from the target in this process (TargetEngine + flashmap.inprocess.decode,
`--slots` sequences decoded together), or from a running stack's Generate
(`--server HOST:PORT`, flashmap.client, `--concurrency` requests in flight). Each sequence
is seeded by (seed, its index), so a chunk's responses do not depend on which process made
them or when.

Defaults: temperature 1, one response per prompt. The paper trains on a fixed set of
500K samples; one response per prompt keeps that shape, and sampling at T = 1 gives the
drafter the target's own distribution (what exact speculative sampling accepts against)
and more than one continuation of similar contexts across the set. Greedy answers
(`--temperature 0`) are one point per context (docs/training.md compares the two).

Resumable (rerun the same command: finished shards are skipped, meta.json must agree) and
sharded over processes: under torchrun each rank takes the chunks c with c % WORLD_SIZE ==
RANK on cuda:LOCAL_RANK (`--workers N --worker I` without torchrun).

    python -m training.generate_data --target /models/Qwen3-8B --prompts train.jsonl \\
        --out data/tokens --max-new-tokens 1024
    torchrun --nproc-per-node 8 -m training.generate_data --target /models/Qwen3-8B \\
        --prompts train.jsonl --out data/tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flashmap.prompts import prompt_split
from training.drafter_data import (
    SHARD_FMT,
    TOKEN_FORMAT,
    _prompts_hash,
    check_or_write_meta,
    generate_responses,
    write_shard,
)

RESUME_KEYS = (
    "format",
    "target_vocab_size",
    "embed_hash",
    "chunk_size",
    "n_prompts",
    "max_new_tokens",
    "temperature",
    "seed",
    "prompts_hash",
    "samples_per_prompt",
)
TOKEN_BYTES = 8  # int64 ids
CONVERSATION_KEYS = ("messages", "conversations", "conversation")
TEXT_KEYS = ("prompt", "instruction", "question", "text", "input")


# ----------------------------------------------------------------------------- prompts


def _messages(conv: list) -> list[dict]:
    """A conversation (OpenAI {role, content} or ShareGPT {from, value}) cut before its last
    assistant turn: the target writes that answer."""
    roles = {"human": "user", "gpt": "assistant", "model": "assistant"}
    msgs = [
        {
            "role": roles.get(m.get("role", m.get("from")), m.get("role", m.get("from"))),
            "content": m.get("content", m.get("value", "")),
        }
        for m in conv
    ]
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs:
        raise ValueError("a conversation without a user turn")
    return msgs


def record_ids(rec: dict, tok, chat: bool) -> list[int]:
    """Token ids of one prompt record (JSONL line or dataset row)."""
    if "prompt_ids" in rec:
        return [int(x) for x in rec["prompt_ids"]]
    for k in CONVERSATION_KEYS:
        if k in rec and isinstance(rec[k], list):
            return tok.encode(tok.render_chat(_messages(rec[k])))
    for k in TEXT_KEYS:
        if isinstance(rec.get(k), str) and rec[k]:
            text = rec[k]
            if chat:
                text = tok.render_chat([{"role": "user", "content": text}])
            return tok.encode(text)
    raise ValueError(f"a prompt record needs prompt_ids, one of {CONVERSATION_KEYS} or {TEXT_KEYS}")


def read_prompts(
    target: str | Path,
    prompts: str | None = None,
    dataset: str | None = None,
    split: str = "train",
    chat: bool = False,
    limit: int = 0,
) -> list[list[int]]:
    """Prompt ids from a JSONL file or a Hugging Face dataset (optional dependency)."""
    from flashmap.tokenizer import TextTokenizer

    tok = None
    if (Path(target) / "tokenizer.json").is_file():
        tok = TextTokenizer(target)
    if dataset:
        try:
            import datasets
        except ImportError:
            raise ValueError(
                "--dataset needs the `datasets` package (pip install datasets); "
                "or export the prompts to JSONL and pass --prompts"
            ) from None
        rows = datasets.load_dataset(dataset, split=split)
        if limit:
            rows = rows.select(range(min(limit, len(rows))))
        return [record_ids(dict(r), tok, chat) for r in rows]
    out = []
    for n, line in enumerate(Path(prompts).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = record_ids(json.loads(line), tok, chat)
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{prompts}:{n}: {e}") from None
        if not ids:
            raise ValueError(f"{prompts}:{n}: empty prompt")
        out.append(ids)
        if limit and len(out) == limit:
            break
    return out


# ----------------------------------------------------------------------------- responses


def server_responses(
    url: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    first_index: int,
    concurrency: int = 16,
    api_key: str | None = None,
) -> list[list[int]]:
    """The responses of a running stack (Generate), seeded as generate_responses seeds them."""
    from flashmap.client import Client

    with Client(url, api_key=api_key) as c:

        def one(i: int) -> list[int]:
            r = c.generate(
                prompt_ids=prompts[i],
                max_new_tokens=max_new_tokens,
                temperature=float(temperature),
                seed=int(seed) * 1_000_003 + first_index + i,
            )
            return list(r.token_ids)

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            return list(pool.map(one, range(len(prompts))))


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}"
        n /= 1000
    return ""


def _duration(s: float) -> str:
    h, m = divmod(int(s) // 60, 60)
    return f"{h} h {m} min" if h else f"{m} min {int(s) % 60} s"


def generate(
    prompts: list[list[int]],
    out_dir: str | Path,
    *,
    target: str | Path,
    respond,
    vocab_size: int,
    max_new_tokens: int = 512,
    temperature: float = 1.0,
    seed: int = 0,
    samples_per_prompt: int = 1,
    chunk_size: int = 256,
    worker: int = 0,
    workers: int = 1,
    source: str = "engine",
    progress: bool = True,
    say=print,
    split: str = "",
) -> list[Path]:
    """Write this worker's shards of token data into out_dir; returns the paths it wrote or
    found. respond(prompts, first_index) -> responses (stop token kept). split: of the
    prompts, kept in meta.json (training.drafter_data.build)."""
    from tqdm import tqdm

    from drafter_service.checkpoint import tensor_hash
    from flashmap.checkpoint import load_embeddings, read_config
    from flashmap.types import feature_layers_for

    if samples_per_prompt < 1 or chunk_size < 1 or max_new_tokens < 1:
        raise ValueError("samples_per_prompt, chunk_size and max_new_tokens must be >= 1")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError("several samples per prompt need temperature > 0")
    seqs = [p for p in prompts for _ in range(samples_per_prompt)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(
        format=TOKEN_FORMAT,
        target=str(target),
        target_vocab_size=vocab_size,
        embed_hash=tensor_hash(load_embeddings(target)[0]),
        chunk_size=chunk_size,
        n_prompts=len(seqs),
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        seed=seed,
        prompts_hash=_prompts_hash(seqs),
        samples_per_prompt=samples_per_prompt,
        source=source,
        split=split,
    )
    check_or_write_meta(out_dir, meta, RESUME_KEYS)
    n_chunks = -(-len(seqs) // chunk_size)
    mine = [c for c in range(n_chunks) if c % workers == worker]
    todo = [c for c in mine if not (out_dir / SHARD_FMT.format(c)).is_file()]
    most = sum(len(p) + max_new_tokens for p in seqs)
    tc = read_config(target)
    feat = len(feature_layers_for(int(tc["num_hidden_layers"]))) * int(tc["hidden_size"]) * 2
    say(
        f"[generate_data] {len(prompts):,} prompts x {samples_per_prompt} = {len(seqs):,} "
        f"sequences in {n_chunks} chunks; worker {worker} of {workers}: {len(mine)} chunks, "
        f"{len(mine) - len(todo)} done already\n"
        f"  disk: at most {_bytes(most * TOKEN_BYTES)} of token ids for all workers "
        f"({TOKEN_BYTES} bytes a token, up to {max_new_tokens} new tokens each; the target's "
        f"features offline would take {_bytes(most * feat)} at {feat:,} bytes a token)"
    )
    paths, t0, made = [], None, 0
    bar = tqdm(todo, desc="responses", unit="chunk", disable=not progress)
    for c in bar:
        chunk = seqs[c * chunk_size : (c + 1) * chunk_size]
        t = time.perf_counter()
        responses = respond(chunk, c * chunk_size)
        made += sum(len(r) for r in responses)
        paths.append(write_shard(out_dir / SHARD_FMT.format(c), chunk, responses, None))
        if t0 is None:  # the first chunk sets the estimate
            t0 = time.perf_counter() - t
            say(
                f"  first chunk: {made / t0:,.0f} new tokens/s; this worker's {len(todo)} chunks "
                f"take about {_duration(t0 * len(todo))}"
            )
        bar.set_postfix(new_tokens=made)
    return sorted(paths + [out_dir / SHARD_FMT.format(c) for c in mine if c not in todo])


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.generate_data", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True, help="target checkpoint directory (HF Qwen3)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL prompt file")
    src.add_argument("--dataset", help="a Hugging Face dataset name (needs `datasets`)")
    ap.add_argument("--split", default="train", help="--dataset: the split")
    ap.add_argument("--chat", action="store_true", help="text prompts as a user message")
    ap.add_argument("--out", required=True, help="output directory (resumable)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--samples-per-prompt", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0 = all)")
    ap.add_argument("--chunk-size", type=int, default=256, help="sequences per shard")
    ap.add_argument("--server", help="HOST:PORT of a running stack's Generate (else in process)")
    ap.add_argument("--concurrency", type=int, default=16, help="--server: requests in flight")
    ap.add_argument("--slots", type=int, default=64, help="in process: sequences decoded at once")
    ap.add_argument("--max-seq-len", type=int, default=None, help="in process: the engine's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--workers", type=int, default=None, help="processes sharing the chunks")
    ap.add_argument("--worker", type=int, default=None, help="this process's index")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    workers = a.workers or int(os.environ.get("WORLD_SIZE", "1"))
    worker = a.worker if a.worker is not None else int(os.environ.get("RANK", "0"))
    device = a.device
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    from flashmap.checkpoint import read_config

    try:
        prompts = read_prompts(a.target, a.prompts, a.dataset, a.split, a.chat, a.limit)
        vocab = int(read_config(a.target)["vocab_size"])
        if a.server:
            source = f"server {a.server}"

            def respond(chunk, first):
                return server_responses(
                    a.server,
                    chunk,
                    a.max_new_tokens,
                    a.temperature,
                    a.seed,
                    first,
                    a.concurrency,
                    os.environ.get("FLASHMAP_API_KEY"),
                )
        else:
            from target_service.engine import TargetEngine

            source = "engine"
            dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
            engine = TargetEngine(
                a.target,
                n_slots=a.slots,
                max_seq_len=a.max_seq_len,
                device=device,
                dtype=getattr(torch, dtype),
            )

            def respond(chunk, first):
                return generate_responses(
                    engine, chunk, a.max_new_tokens, a.temperature, a.seed, first
                )

        paths = generate(
            prompts,
            a.out,
            target=a.target,
            respond=respond,
            vocab_size=vocab,
            max_new_tokens=a.max_new_tokens,
            temperature=a.temperature,
            seed=a.seed,
            samples_per_prompt=a.samples_per_prompt,
            chunk_size=a.chunk_size,
            worker=worker,
            workers=workers,
            source=source,
            progress=not a.no_progress,
            split=prompt_split(a.prompts) if a.prompts else "",
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(paths)} shards of token data in {a.out} (worker {worker} of {workers})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
