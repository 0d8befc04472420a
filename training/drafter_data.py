"""Self-distillation data for the drafters (FlashMap and the DFlash-style baseline).

For a list of prompts the target writes its own responses (greedy or sampled, with the
in-process decoder `flashmap.inprocess.decode`), then one `TargetEngine.verify` prefill
row per sequence gives the feature-layer hidden states of every position of
prompt + response ([L, F]). Drafters are trained on exactly what they will see when
serving: the target's own continuations and the target's own features.

Output directory:

    meta.json                   target reference (vocab, feature layers, embedding hash),
                                generation settings, chunk size
    shard-00000.safetensors     one chunk of `chunk_size` prompts:
        tokens       [N] int64     prompt + response ids of all sequences, concatenated
        offsets      [n+1] int64   sequence i is tokens[offsets[i]:offsets[i+1]]
        prompt_lens  [n] int64     the response of sequence i starts at offsets[i] + prompt_lens[i]
        features     [N, F]        target features (bfloat16 by default: the range of fp32, half the bytes)

Resumable: a chunk whose shard already exists is skipped (shards are written to a
temporary file and renamed, so an existing shard is complete); meta.json must match
the settings of the run that continues it.

Token data (`training.generate_data`, format "flashmap-token-data") are the same shards
without `features`: the trainer computes them online with the target
(`training.online_features`). `read_meta(..., tokens_ok=True)` accepts both kinds.

    python -m training.drafter_data --target checkpoints/demo-target \
        --prompts demo/data/dev_prompts.jsonl --out data/drafter --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flashmap.prompts import prompt_split, read_prompt_lines
from flashmap.types import SamplingParams, VerifyRow

META_FILE = "meta.json"
SHARD_FMT = "shard-{:05d}.safetensors"
FORMAT = "flashmap-drafter-data"
TOKEN_FORMAT = "flashmap-token-data"  # the same shards without features (training.generate_data)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Settings that must agree between a run and the run that resumes it.
_RESUME_KEYS = (
    "format",
    "target_vocab_size",
    "feature_layers",
    "feature_dim",
    "embed_hash",
    "chunk_size",
    "n_prompts",
    "max_new_tokens",
    "temperature",
    "seed",
    "feature_dtype",
    "prompts_hash",
    "samples_per_prompt",
)


# ----------------------------------------------------------------------------- prompts


def read_prompts(path: str | Path, target_dir: str | Path | None = None) -> list[list[int]]:
    """Prompts from a JSONL file (see read_prompt_lines)."""
    return [ids for _, _, ids in read_prompt_lines(path, target_dir)]


def _prompts_hash(prompts: list[list[int]]) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in prompts:
        h.update(np.asarray(p, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- generation


def generate_responses(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    first_index: int = 0,
) -> list[list[int]]:
    """The target's own responses (stop token kept) for prompts, batched over the engine's
    slots. Sampling is seeded per prompt by (seed, global prompt index), so a chunk gives
    the same responses whether or not earlier chunks ran in the same process."""
    from flashmap.inprocess import decode
    from flashmap.types import GenerationRequest

    reqs = []
    for i, p in enumerate(prompts):
        room = engine.max_seq_len - len(p)
        if room < 1:
            raise ValueError(
                f"prompt {first_index + i} has {len(p)} tokens; the target holds {engine.max_seq_len}"
            )
        params = SamplingParams(
            temperature=float(temperature), seed=int(seed) * 1_000_003 + first_index + i
        )
        reqs.append(
            GenerationRequest(
                list(p),
                max_new_tokens=min(max_new_tokens, room),
                params=params,
                stop_token_ids=tuple(engine.eos_token_ids),
                request_id=str(first_index + i),
            )
        )
    return [r.token_ids for r in decode(engine, reqs)]


def target_features(engine, sequences: list, features_on_device: bool = False) -> list:
    """Features [L, F] float32 of every position of each sequence: one prefill row per
    sequence, as many rows per verify pass as the engine has slots. features_on_device: as
    tensors on the engine's device, in its features dtype (the online trainer's,
    training.online_features), else numpy arrays."""
    out: list = []
    for b in range(0, len(sequences), engine.n_slots):
        group = sequences[b : b + engine.n_slots]
        slots = [engine.allocate() for _ in group]
        try:
            rows = [
                VerifyRow(
                    slot=s, start_pos=0, tokens=np.asarray(seq, np.int64), params=SamplingParams()
                )
                for s, seq in zip(slots, group)
            ]
            out.extend(r.features for r in engine.verify(rows, features_on_device))
        finally:
            for s in slots:
                engine.release(s)
    return out


# ----------------------------------------------------------------------------- shards


def write_shard(
    path: str | Path,
    prompts: list[list[int]],
    responses: list[list[int]],
    features: list[np.ndarray] | None,
    feature_dtype: str = "bfloat16",
) -> Path:
    """One shard (atomic: temporary file + rename); features None: a token-data shard."""
    path = Path(path)
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    lens = [len(s) for s in seqs]
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
        "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
    }
    if features is not None:
        for s, f in zip(seqs, features):
            if f.shape[0] != len(s):
                raise ValueError(
                    f"features have {f.shape[0]} rows for a sequence of {len(s)} tokens"
                )
        tensors["features"] = (
            torch.from_numpy(np.concatenate(features, 0)).to(DTYPES[feature_dtype]).contiguous()
        )
    tmp = path.with_name("." + path.name + ".tmp")
    fmt = FORMAT if features is not None else TOKEN_FORMAT
    save_file(tensors, str(tmp), metadata={"format": fmt, "count": str(len(seqs))})
    os.replace(tmp, path)
    return path


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] int64, prompt + response
    features: torch.Tensor | None  # [L, F]; None in token data (computed online)
    prompt_len: int


class Shard:
    """Lazy view of one shard: sequences are read on access (memory-mapped), so a shard of
    large-target features need not fit in memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = safe_open(str(path), "pt")
        self.offsets = self._f.get_tensor("offsets").tolist()
        self.prompt_lens = self._f.get_tensor("prompt_lens").tolist()
        self._tokens = self._f.get_tensor("tokens")
        self._features = self._f.get_slice("features") if "features" in self._f.keys() else None

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, i: int) -> Sequence:
        a, b = self.offsets[i], self.offsets[i + 1]
        feats = None if self._features is None else self._features[a:b]
        return Sequence(self._tokens[a:b], feats, int(self.prompt_lens[i]))


def read_shard(path: str | Path) -> list[Sequence]:
    """All sequences of a shard, in memory."""
    t = load_file(str(path))
    off = t["offsets"].tolist()
    feats = t.get("features")
    return [
        Sequence(t["tokens"][a:b], None if feats is None else feats[a:b], int(p))
        for a, b, p in zip(off[:-1], off[1:], t["prompt_lens"].tolist())
    ]


def shard_count(path: str | Path) -> int:
    """Sequences in a shard, read from its header only."""
    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["count"])


def shard_index(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1], prompt_lens [n]) of a shard, without reading tokens or features."""
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("offsets").numpy(), f.get_tensor("prompt_lens").numpy()


def list_shards(data_dir: str | Path) -> list[Path]:
    shards = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"{data_dir}: no shard-*.safetensors (run python -m training.drafter_data first)"
        )
    return shards


def read_meta(data_dir: str | Path, tokens_ok: bool = False) -> dict:
    """meta.json of a drafter data directory (with tokens_ok: or of token data, whose
    features the trainer computes online)."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (not a drafter data directory?)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT and not (tokens_ok and meta.get("format") == TOKEN_FORMAT):
        what = "drafter data or token data" if tokens_ok else "drafter data"
        hint = (
            " (token data: the features are computed online by training.train_drafter)"
            if meta.get("format") == TOKEN_FORMAT
            else ""
        )
        raise ValueError(f"{path}: not {what} (format {meta.get('format')!r}){hint}")
    return meta


def check_or_write_meta(out_dir: Path, meta: dict, keys: tuple[str, ...]) -> None:
    """Write meta.json into out_dir, or check that the one there agrees on `keys` (a resumed
    run must continue with the settings it started with). Written atomically."""
    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        old.setdefault("samples_per_prompt", 1)  # written before the option existed
        diff = [k for k in keys if old.get(k) != meta[k]]
        if diff:
            raise ValueError(
                f"{out_dir} holds data made with other settings ({', '.join(diff)}); "
                f"use another --out or delete it"
            )
        return
    tmp = out_dir / f".{META_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, meta_path)


# ----------------------------------------------------------------------------- build


def build(
    engine,
    prompts: list[list[int]],
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    chunk_size: int = 64,
    feature_dtype: str = "bfloat16",
    target_dir: str | Path | None = None,
    progress: bool = True,
    samples_per_prompt: int = 1,
    split: str = "",
) -> list[Path]:
    """Generate responses and features for all prompts into out_dir; returns the shard paths.
    split: of the prompts (flashmap.prompts.prompt_split), kept in meta.json so that a path
    that chooses refuses data of the test prompts.
    Chunks whose shard exists are skipped. samples_per_prompt > 1 (with temperature > 0):
    each prompt answered that many times (consecutive sequences, each seeded by its own
    index), so the data hold several continuations of one context: multimodal blocks."""
    if samples_per_prompt < 1:
        raise ValueError("samples_per_prompt must be >= 1")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError(
            "several samples per prompt need temperature > 0 (greedy answers are all the same)"
        )
    prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    from tqdm import tqdm

    if feature_dtype not in DTYPES:
        raise ValueError(f"feature_dtype must be one of {sorted(DTYPES)}, got {feature_dtype!r}")
    if chunk_size < 1 or max_new_tokens < 1:
        raise ValueError("chunk_size and max_new_tokens must be >= 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    embed_hash = ""
    if target_dir is not None:
        from drafter_service.checkpoint import tensor_hash
        from flashmap.checkpoint import load_embeddings

        embed_hash = tensor_hash(load_embeddings(target_dir)[0])
    meta = dict(
        format=FORMAT,
        target=str(target_dir or ""),
        target_vocab_size=engine.vocab_size,
        target_hidden_size=engine.hidden_size,
        target_num_layers=engine.num_layers,
        feature_layers=engine.feature_layers,
        feature_dim=engine.feature_dim,
        embed_hash=embed_hash,
        chunk_size=chunk_size,
        n_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        seed=seed,
        feature_dtype=feature_dtype,
        prompts_hash=_prompts_hash(prompts),
        samples_per_prompt=samples_per_prompt,
        split=split,
    )
    check_or_write_meta(out_dir, meta, _RESUME_KEYS)

    n_chunks = (len(prompts) + chunk_size - 1) // chunk_size
    paths = []
    bar = tqdm(range(n_chunks), desc="drafter data", unit="chunk", disable=not progress)
    for c in bar:
        path = out_dir / SHARD_FMT.format(c)
        paths.append(path)
        if path.is_file():
            continue  # resumed: written by an earlier run
        chunk = prompts[c * chunk_size : (c + 1) * chunk_size]
        responses = generate_responses(
            engine, chunk, max_new_tokens, temperature, seed, c * chunk_size
        )
        feats = target_features(engine, [list(p) + list(r) for p, r in zip(chunk, responses)])
        write_shard(path, chunk, responses, feats, feature_dtype)
        bar.set_postfix(resp_tokens=sum(len(r) for r in responses))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.drafter_data", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--target", required=True, help="target checkpoint directory (HF Qwen3)")
    ap.add_argument(
        "--prompts", required=True, help='JSONL with "prompt" (text) or "prompt_ids" per line'
    )
    ap.add_argument("--out", required=True, help="output directory (resumable)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="answers per prompt (temperature > 0): several continuations of one context",
    )
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=64,
        help="prompts per shard (Qwen3-8B: 5 x 4096 features = 40 KB per token in bf16)",
    )
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    ap.add_argument("--slots", type=int, default=8, help="sequences decoded / prefilled at once")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument(
        "--feature-dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="stored feature dtype (bf16 keeps the range of large activations)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="target compute dtype"
    )
    args = ap.parse_args(argv)
    from target_service.engine import TargetEngine

    try:
        prompts = read_prompts(args.prompts, args.target)
        if args.limit:
            prompts = prompts[: args.limit]
        engine = TargetEngine(
            args.target,
            n_slots=args.slots,
            max_seq_len=args.max_seq_len,
            device=args.device,
            dtype=DTYPES[args.dtype],
        )
        paths = build(
            engine,
            prompts,
            args.out,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            chunk_size=args.chunk_size,
            feature_dtype=args.feature_dtype,
            target_dir=args.target,
            samples_per_prompt=args.samples_per_prompt,
            split=prompt_split(args.prompts),
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(paths)} shards in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
