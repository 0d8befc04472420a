"""Copy a trained drafter run into a small, committable checkpoint directory.

Keeps config.json, loss.csv and loss.png, drops the training state, and stores the
weights in bfloat16 (half the bytes; they load back into fp32, see
drafter_service/checkpoint.py). The weights file records the stored dtype.

    python -m training.export_drafter runs/demo/map checkpoints/demo-flashmap
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KEEP = ("config.json", "loss.csv", "loss.png")
WEIGHTS = "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    src, dst = Path(src), Path(dst)
    if not (src / WEIGHTS).is_file() or not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: not a drafter checkpoint (config.json + {WEIGHTS})")
    dst.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / WEIGHTS), "pt") as f:
        meta = dict(f.metadata() or {})
        weights = {k: f.get_tensor(k).to(DTYPES[dtype]).contiguous() for k in f.keys()}
    save_file(weights, str(dst / WEIGHTS), metadata={**meta, "stored_dtype": dtype})
    for name in KEEP:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.export_drafter", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("src", help="a training output directory (train_drafter / train_eagle --out)")
    ap.add_argument("dst", help="the checkpoint directory to write")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = ap.parse_args(argv)
    try:
        print(f"drafter checkpoint in {export(args.src, args.dst, args.dtype)}")
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
