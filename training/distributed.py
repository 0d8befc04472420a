"""Several processes, one training run: torchrun's environment, the process group, the
wrapper that keeps the replicas in step (DDP, or FSDP2), and what a checkpoint must hold
of every rank.

torchrun starts one process per device with RANK / WORLD_SIZE / LOCAL_RANK set; `init`
joins them (NCCL on GPUs, each process on cuda:LOCAL_RANK; gloo on the CPU) and returns a
`Dist`. Without torchrun it returns the single-process Dist and nothing else changes.

- DDP (the default): each rank holds the whole drafter, its gradients are averaged across
  the ranks in backward (bucketed all-reduce), every optimizer step leaves the replicas
  identical. The drafter's buffers (the target's frozen embedding / LM head, shared with
  the rank's target copy) are neither broadcast nor synced: every rank has the same target.
- FSDP2 (`--fsdp`, torch.distributed.fsdp.fully_shard over the loss module as one unit):
  parameters, gradients and AdamW moments are sharded across the ranks and gathered for the
  step. It is for a drafter whose training state does not fit one device beside the target
  (16 bytes per parameter: a 0.5B drafter needs 8 GB and fits an H200 with Qwen3-8B, so the
  paper's setting runs under DDP). The target copy is not sharded: every rank holds it
  whole (a target that does not fit one device is not supported).

Checkpoints hold every rank's RNG (torch, CUDA, numpy, Python), gathered to rank 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

TIMEOUT = timedelta(minutes=60)  # rank 0 runs the held-out checks while the others wait


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group is up (torchrun with more than one process)."""
        return self.world > 1


def init(device: str | None = None) -> Dist:
    """Join torchrun's process group (if launched by torchrun with WORLD_SIZE > 1). device:
    "cuda" puts rank r on cuda:LOCAL_RANK, "cpu" keeps every rank on the CPU (gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    dev = torch.device(kind, local) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT, device_id=dev if kind == "cuda" else None)
    return Dist(rank, world, local, dev)


def shutdown(d: Dist, finished: bool = True) -> None:
    """Leave the process group. finished: every rank got here without error, so they first meet
    at a barrier: a rank that tears gloo down while its peer still talks to it can abort at
    exit ("terminate called without an active exception"). After an error no barrier (a peer
    may never come)."""
    if d.enabled and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def barrier(d: Dist | None) -> None:
    if d is not None and d.enabled:
        dist.barrier()


def gather(obj, d: Dist | None) -> list:
    """obj of every rank, in rank order (on every rank)."""
    if d is None or not d.enabled:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- wrapping


class LossModule(nn.Module):
    """The drafter with the stage's loss as its forward, so DDP / FSDP2 see one forward per
    micro-batch (their gradient sync is armed there) whatever the loss calls on the model."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch):
        return self._loss_fn(batch)


def wrap(model: nn.Module, loss_fn, d: Dist | None, fsdp: bool = False) -> nn.Module:
    """The module to call per micro-batch: LossModule(model, loss_fn), under DDP or FSDP2 when
    there are several ranks. Buffers are left alone (every rank computes the same)."""
    m = LossModule(model, loss_fn)
    if d is None or not d.enabled:
        return m
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(m, mesh=init_device_mesh(d.device.type, (d.world,)))
        return m
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP._set_params_and_buffers_to_ignore_for_model(m, [n for n, _ in m.named_buffers()])
    # Every buffer is ignored: neither broadcast at the start nor synced in forward.
    return DDP(m, device_ids=[d.local_rank] if d.device.type == "cuda" else None)


def sync_gradients(wrapped: nn.Module, on: bool):
    """Context for one micro-batch's forward + backward: gradients are synced across ranks only
    when `on` (the last micro-batch of an accumulated step)."""
    if hasattr(wrapped, "no_sync"):  # DDP
        return contextlib.nullcontext() if on else wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(on)
    return contextlib.nullcontext()


def is_sharded(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 parameter (a collective: every rank calls it), else t."""
    return t.full_tensor() if is_sharded(t) else t


def full_state(model: nn.Module, opt, fsdp: bool) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict), whole (FSDP2: gathered, on the CPU; a
    collective). Without FSDP2 the plain state dicts."""
    if not fsdp:
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=o), get_optimizer_state_dict(model, opt, options=o)


def load_full_state(model: nn.Module, opt, model_sd: dict, opt_sd: dict, fsdp: bool) -> None:
    """Inverse of full_state, on every rank."""
    if not fsdp:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=o)
    set_optimizer_state_dict(model, opt, opt_sd, options=o)


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's random generators (torch CPU and CUDA, numpy's global, Python's)."""
    st = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ----------------------------------------------------------------------------- checks


def param_digest(model: nn.Module) -> str:
    """sha256 of the model's parameters (names, and bytes of this rank's values: the local
    shard under FSDP2)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.to_local() if is_sharded(p) else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def peak_memory(device) -> str:
    """This process's peak memory so far: allocated on its GPU, else its resident set."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(dev) / 1e9:.2f} GB allocated on {dev}"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB resident (host)"
