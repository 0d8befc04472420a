"""The drafter service's options: each one a field here, its flag and environment variable made
from it (flashmap.config); `python -m drafter_service.server --help` lists them."""

from __future__ import annotations

from dataclasses import dataclass

from flashmap.auth import DRAFTER_TOKEN_ENV
from flashmap.config import Config, at_least, in_range, option
from flashmap.cpus import DRAFTER_CPUS_ENV, parse_cpu_list
from flashmap.types import DRAFT_STEPS, ESTIMATES, check_draft_steps


def _below_one(v: float) -> None:
    if not 0.0 <= v < 1.0:
        raise ValueError(f"must be in [0, 1), got {v}")


@dataclass
class DrafterServiceConfig(Config):
    """The drafter service's options (flags and environment variables: flashmap.config)."""

    target_dir: str = option(
        help="the target checkpoint: the frozen embedding and LM head, checked against the drafter",
        env="FLASHMAP_TARGET_DIR",
    )
    drafter: str = option("init", "drafter checkpoint dir, or 'init'", env="FLASHMAP_DRAFTER_DIR")
    host: str = option("127.0.0.1", "listen address", env="FLASHMAP_HOST")
    port: int = option(50052, "gRPC Drafter", env="FLASHMAP_DRAFTER_PORT", check=at_least(0))
    metrics_port: int = option(
        9401, "Prometheus /metrics; 0 = off", env="FLASHMAP_DRAFTER_METRICS_PORT", check=at_least(0)
    )
    steps: int = option(
        DRAFT_STEPS,
        "draft_steps of a request without its own: 1 or 2 flow-map jumps, or N Euler steps "
        "(switch at run time: SetSteps, flashmap steps)",
        env="FLASHMAP_DRAFT_STEPS",
        check=check_draft_steps,
    )
    min_confidence: float = option(
        0.0,
        "cut greedy drafts before the first slot whose token has a lower drafter probability "
        "(0: off)",
        env="FLASHMAP_DRAFT_MIN_CONFIDENCE",
        check=_below_one,
    )
    # FlashMap checkpoints draft as the paper does unless one of these departures is named
    # (FlashMapProposer; docs/drafters.md: what each costs).
    per_slot_noise: bool = option(
        False,
        "departure: one noise draw per slot instead of one per block (the paper's)",
        env="FLASHMAP_PER_SLOT_NOISE",
    )
    greedy_estimate: str = option(
        "soft",
        "T = 0 requests: clean-block estimate between flow-map jumps (soft: the paper's; "
        "argmax: a departure, mode-seeking drafting)",
        env="FLASHMAP_GREEDY_ESTIMATE",
        choices=ESTIMATES,
    )
    greedy_noise_scale: float = option(
        1.0,
        "T = 0 requests: scale of the initial flow noise (1: the paper's; 0: a departure, "
        "drafting from the zero state, for maps distilled with zero-state jumps)",
        env="FLASHMAP_GREEDY_NOISE_SCALE",
        check=in_range(0.0, 1.0),
    )
    second_jump_net: bool = option(
        False,
        "departure: the checkpoint's second-jump network takes the second of two jumps of "
        "T = 0 requests (needs --greedy-noise-scale 0 and the estimate it was trained with)",
        env="FLASHMAP_SECOND_JUMP_NET",
    )
    eagle3_chains: bool = option(
        False,
        "EAGLE-3 checkpoints, temperature > 0: a chain of 16 sampled from the drafter's top-m "
        "(verified by rejection sampling; with the orchestrator's --tree-sampling siblings, "
        "each token's other top-m tokens beside it) instead of the dynamic tree",
        env="FLASHMAP_EAGLE3_CHAINS",
    )
    n_slots: int = option(64, "sequences whose context the drafter holds", check=at_least(1))
    max_context: int = option(4096, "positions of context per sequence", check=at_least(1))
    idle_timeout_s: float = option(
        300.0, "forget a sequence unused this long", check=at_least(0.001)
    )
    device: str | None = option(
        None, "cpu, cuda, cuda:N (default: cuda if available)", env="FLASHMAP_DEVICE"
    )
    cuda_graphs: bool = option(
        True, "on CUDA, replay graphs captured at start-up (off: draft eagerly)"
    )
    compile: bool = option(
        False, "on CPU, torch.compile the drafter at start-up", env="FLASHMAP_DRAFT_COMPILE"
    )
    reflection: bool = option(False, "serve gRPC reflection (off: less to probe)")
    probe_interval_s: float = option(
        5.0, "health: a tiny draft this often (0: off)", check=at_least(0)
    )
    cpus: str | None = option(
        None,
        "CPU list for the forward thread, e.g. 0-1 (flashmap.cpus; default: the process's)",
        env=DRAFTER_CPUS_ENV,
        check=parse_cpu_list,
    )
    token: str = option(
        "", "every call but health must carry it", env=DRAFTER_TOKEN_ENV, secret=True
    )
    log_level: str = option("INFO", "logging level", env="FLASHMAP_LOG_LEVEL")
