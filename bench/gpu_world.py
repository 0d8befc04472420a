"""What the GPU proof's stack and training sections run on (scripts/gpu-proof.sh), written once:

    python -m bench.gpu_world --out DIR            (Qwen3-8B's shape, bf16, on the GPU: ~16 GB)
    python -m bench.gpu_world --out DIR --smoke    (a tiny Qwen3 on the CPU, fp32)

- DIR/target: a Qwen3 checkpoint (config.json + model.safetensors, the layout every part
  loads) with random weights drawn on the device: matrices N(0, std) with std = 2.5 /
  sqrt(hidden) (target_service.random_checkpoint.default_init_std: peaked logits, few
  near-ties between the top two), norm gains around 1; no tokenizer (token ids only);
- DIR/drafter: a FlashMap drafter checkpoint for it with random weights (the paper's size on
  the 8B shape: dim 2048, 6 blocks, 16 heads; tiny with --smoke), so the served target applies
  its context projection as it would a trained one's;
- DIR/prompts.jsonl: prompts of random ids ({"prompt_ids": [...]}), for the token data of the
  training section (training.generate_data): sequences of prompt + response that fill the
  trainer's 2,048 positions.

Nothing is downloaded; the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu_target import QWEN3_8B, TINY_TARGET, random_qwen3

SMOKE_DRAFTER = dict(dim=64, n_blocks=2, n_heads=4)  # factory.load_model's size for small targets
SIZES = {  # prompts, prompt length: prompt + response (--response) fill max_len
    "gpu": dict(prompts=32, prompt_len=2000),
    "smoke": dict(prompts=16, prompt_len=40),
}


def hf_config(shape: dict, dtype: torch.dtype) -> dict:
    """config.json of a Qwen3ForCausalLM of this shape (the keys transformers writes that the
    parts read)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **shape,
    }


def write_target(path: Path, shape: dict, dev, dtype, seed: int = 0) -> dict:
    """The random checkpoint: drawn on dev, written as one safetensors file."""
    from safetensors.torch import save_file

    from target_service.random_checkpoint import default_init_std

    t = time.perf_counter()
    model = random_qwen3(shape, dev, dtype, default_init_std(shape["hidden_size"]), seed)
    drawn = time.perf_counter() - t
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(shape, dtype), indent=2) + "\n")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    size = sum(v.numel() * v.element_size() for v in state.values())
    return {"bytes": size, "draw_s": round(drawn, 2), "total_s": round(time.perf_counter() - t, 2)}


def write_drafter(path: Path, target: Path, smoke: bool, dev, dtype) -> dict:
    """A FlashMap drafter checkpoint for the target, random weights (seeded)."""
    from drafter_service.checkpoint import init_drafter, save_drafter

    t = time.perf_counter()
    with torch.device(dev):  # built where it runs: the whitening of E (V x H^2) on the GPU
        model = init_drafter(
            target, seed=0, device=str(dev), dtype=dtype, **(SMOKE_DRAFTER if smoke else {})
        )
    save_drafter(model, path)
    cfg = model.cfg
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "arch": {k: getattr(cfg, k) for k in ("dim", "n_blocks", "n_heads")},
        "total_s": round(time.perf_counter() - t, 2),
    }


def write_prompts(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"prompt_ids": rng.integers(3, vocab, length).tolist()}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_world",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="directory to write")
    ap.add_argument("--smoke", action="store_true", help="a tiny Qwen3 on the CPU")
    ap.add_argument("--prompts", type=int, default=None, help="prompts to write")
    ap.add_argument("--prompt-len", type=int, default=None, help="ids per prompt")
    a = ap.parse_args(argv)
    if a.smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        shape = dict(TINY_TARGET, eos_token_id=[TINY_TARGET["vocab_size"] - 1])
    elif torch.cuda.is_available():
        dev, dtype, shape = torch.device("cuda"), torch.bfloat16, dict(QWEN3_8B)
    else:
        print("bench.gpu_world: no CUDA device here; --smoke writes a tiny world on the CPU")
        return 2
    size = SIZES["smoke" if a.smoke else "gpu"]
    out = a.out
    report = {"target": write_target(out / "target", shape, dev, dtype)}
    report["drafter"] = write_drafter(out / "drafter", out / "target", a.smoke, dev, dtype)
    n, length = a.prompts or size["prompts"], a.prompt_len or size["prompt_len"]
    write_prompts(out / "prompts.jsonl", n, length, shape["vocab_size"])
    report["prompts"] = {"n": n, "length": length}
    (out / "world.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"bench.gpu_world: {out}: {json.dumps(report)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
