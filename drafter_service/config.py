"""Typed configuration of a drafter (FlashMap DiT or the DFlash-style baseline).

One dataclass holds everything a drafter checkpoint needs to be rebuilt and checked:
architecture, the target it was made for (shape + content hashes of the frozen
embedding / LM head), the feature layers it reads, the block size and the flow
settings (time map, drafting defaults, training loss knobs). It is what
config.json of a drafter checkpoint directory contains (see drafter_service/checkpoint.py).
Defaults follow the paper (docs/ARCHITECTURE.md): 6 blocks, width 2048, 16 heads, K = 16.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from drafter_service.flow_time import TIME_MAPS, check_knots
from flashmap.types import BLOCK_SIZE, DRAFT_STEPS, ESTIMATES

KINDS = ("flashmap", "dflash")
STATE_INPUTS = ("whiten", "rms")
# Fields a config.json written before they existed lacks: it gets these (the old behaviour),
# not the dataclass defaults (what new drafters get).
LEGACY_DEFAULTS = {"time_map": "vocab", "state_input": "rms"}


class TargetRefConfig:
    """What every drafter config dataclass shares (DrafterConfig, eagle.EagleConfig): the
    width / heads / target-reference fields' derived values and checks, and the JSON dict
    form. Subclasses are dataclasses with the fields dim, n_heads, vocab_size,
    target_hidden_size, target_num_layers and feature_layers; `_WHAT` names them in errors."""

    _WHAT = "drafter"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def feature_dim(self) -> int:
        """Width F of the concatenated target features one position contributes."""
        return len(self.feature_layers) * self.target_hidden_size

    def _check_widths(self, positive: tuple[str, ...]) -> None:
        """The named fields are >= 1 and dim splits into heads of even width."""
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of even width")

    def _check_target(self) -> None:
        """The target fields are set and the feature layers lie inside the target."""
        if self.vocab_size < 2 or self.target_hidden_size < 1 or self.target_num_layers < 1:
            raise ValueError(
                "target fields (vocab_size >= 2, target_hidden_size, target_num_layers) are not set"
            )
        if not self.feature_layers:
            raise ValueError("feature_layers is empty")
        bad = [l for l in self.feature_layers if not 0 <= l < self.target_num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} outside 0..{self.target_num_layers - 1}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls._WHAT} config fields {unknown}")
        cfg = cls(**d)
        cfg.feature_layers = [int(x) for x in cfg.feature_layers]
        return cfg


@dataclass
class DrafterConfig(TargetRefConfig):
    # --- architecture
    kind: str = "flashmap"  # "flashmap" (flow map on one-hot blocks) | "dflash" (one pass over a masked block)
    dim: int = 2048
    n_blocks: int = 6
    n_heads: int = 16
    mlp_ratio: float = 4.0  # DiT default
    block_size: int = BLOCK_SIZE  # K draft slots per block
    time_freq_dim: int = 256  # sinusoidal embedding width, per time (s and t)
    rope_theta: float = 10000.0  # cross-attention RoPE over absolute positions
    norm_eps: float = 1e-6
    qk_norm: bool = True  # RMSNorm on queries/keys per head (stabilises attention logits)

    # --- the target this drafter was made for (filled from the target checkpoint)
    target_name: str = ""
    vocab_size: int = 0
    target_hidden_size: int = 0
    target_num_layers: int = 0
    feature_layers: list[int] = field(default_factory=list)  # decoder-layer outputs, 0-based
    embed_hash: str = ""  # checkpoint.tensor_hash of the target's input embedding [V, H]
    lm_head_hash: str = ""  # checkpoint.tensor_hash of the target's LM head [V, H]

    # --- flow settings
    # Recorded with the checkpoint; what serves is the drafter service's --steps.
    draft_steps: int = DRAFT_STEPS
    # One noise draw [V] shared by all K slots (True), or one per slot (False). Shared noise makes
    # the slots' differences noise-free (x_t,k - x_t,j = t (e_yk - e_yj)): the states of
    # different blocks lie on disjoint subspaces for every t > 0, no smooth flow from one
    # shared draw reaches them, and a denoiser that learns to read the differences is fed
    # states it never saw as soon as sampling starts (research/joint_task.py measures it).
    shared_noise: bool = False
    slot_loss_decay: float = 7.0  # slot k (1-based) weighted exp(-(k-1)/decay)
    teacher_steps: int = 100  # Euler steps of the teacher ODE (distillation / evaluation)
    # tau <-> t map. "embedded": tau counts the decoding error removed for the Bayes decoder of
    # one slot's embedded state y_t = x_t @ E (what the network can read; flow_time), measured
    # on the target's E when the drafter is made and stored here as knots. "vocab": argmax of
    # x_t in vocabulary space (analytic; drafters made before the embedded map).
    time_map: str = "embedded"
    time_table_t: list[float] = field(
        default_factory=list
    )  # embedded map: knots (t, tau), (0,0)..(1,1)
    time_table_tau: list[float] = field(default_factory=list)
    time_map_samples: int = 16384  # Monte Carlo draws behind the embedded table
    # Embedded map: tau is the mean over these readers of their normalised accuracy; a reader
    # chooses between the true token and m - 1 random others (0: all V). A context that leaves
    # a few candidates makes the state decisive much earlier than the all-V reader says.
    time_map_candidates: list[int] = field(default_factory=lambda: [0])
    time_table_size: int = 4097  # vocab map: points of the tau <-> t lookup table (uniform in t)
    gauss_hermite_nodes: int = 256  # vocab map: quadrature nodes for P[argmax x_t = y]
    # How the network reads the embedded state y [.., H]: "whiten" = y @ W with W^T E^T E W = I
    # (the noise becomes isotropic, every direction of E equally readable), then rms-normalised;
    # "rms" = rms-normalised y (drafters made before whitening).
    state_input: str = "whiten"
    zero_jump_fraction: float = 0.5  # distillation: share of zero-length jumps (s = t)
    # Flow stage: share of blocks trained at tau = 0 (pure noise, where drafting starts).
    # The paper samples tau ~ U(0, 1) only (0.0); a short CPU run needs extra mass there.
    pure_noise_fraction: float = 0.0
    full_jump_fraction: float = 1.0 / 16  # distillation: share of full 0 -> 1 jumps
    # Distillation: share of blocks trained as the full jump 0 -> 1 from the zero state (noise
    # scaled to 0) against the data with cross-entropy, DFlash's loss (0: none, the paper).
    # At T = 0 the target accepts only its argmax, so T = 0 rows draft from the zero state
    # (FlashMapProposer's greedy_noise_scale defaults to 0 for such a map): a trained mode
    # predictor instead of one sample of the flow. T > 0 rows sample the flow as before.
    null_jump_fraction: float = 0.0
    # Share of those zero-state blocks trained along the served two-jump path instead: the jump
    # 0 -> t_1 from the zero state, its soft estimate carried to t_1 (as the proposer does),
    # then t_1 -> 1, the gradient through both and each scored against the data (0: the
    # one-jump path only). Without it the second jump reads a state no training produced.
    null_two_jump_share: float = 0.0
    # The estimate those blocks carry to t_1: "soft" (t_1 * softmax of the first jump, the
    # gradient through both jumps) or "argmax" (t_1 * its one-hot argmax, no gradient into the
    # first jump). The proposer's T = 0 rows carry the same unless told otherwise.
    two_jump_estimate: str = "soft"
    # State gate: the state input is scaled by g = min(1, tau_t / state_gate_tau) (0: no gate,
    # the paper). At tau = 0 the state carries nothing about the block, so the ideal denoiser
    # ignores it; g(0) = 0 makes that exact (a context-only predictor there, as DFlash's), so
    # the noise cannot add variance where drafting starts, while a jump 0 -> t > 0 still reads
    # its noise (the draw that selects the sample).
    state_gate_tau: float = 0.0
    # A network of its own for the second of two jumps of T = 0 rows drafted from the zero state
    # (False: the map's own jump t_1 -> 1, the paper). It has this network's shape (weights
    # `second_jump.*` in the checkpoint), is conditioned on the jump (0, 1) and reads the map's
    # context keys and values and t_1 * the first jump's estimate (two_jump_estimate); trained
    # on that path by research.second_jump_refiner. Rows at T > 0 keep the map's jump.
    second_jump_net: bool = False

    # ---------------------------------------------------------------- derived
    @property
    def mlp_hidden(self) -> int:
        return int(self.dim * self.mlp_ratio)

    # ---------------------------------------------------------------- checks
    def validate(self) -> DrafterConfig:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self._check_widths(
            (
                "dim",
                "n_blocks",
                "n_heads",
                "block_size",
                "time_freq_dim",
                "draft_steps",
                "teacher_steps",
                "gauss_hermite_nodes",
            )
        )
        if self.time_freq_dim % 2:
            raise ValueError(f"time_freq_dim must be even, got {self.time_freq_dim}")
        if self.time_table_size < 3:
            raise ValueError(f"time_table_size must be >= 3, got {self.time_table_size}")
        if self.mlp_ratio <= 0 or self.slot_loss_decay <= 0:
            raise ValueError("mlp_ratio and slot_loss_decay must be > 0")
        for name in (
            "zero_jump_fraction",
            "full_jump_fraction",
            "null_jump_fraction",
            "null_two_jump_share",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.two_jump_estimate not in ESTIMATES:
            raise ValueError(
                f"two_jump_estimate must be one of {ESTIMATES}, got {self.two_jump_estimate!r}"
            )
        if not self.state_gate_tau >= 0:
            raise ValueError(f"state_gate_tau must be >= 0, got {self.state_gate_tau}")
        if self.time_map not in TIME_MAPS:
            raise ValueError(f"time_map must be one of {TIME_MAPS}, got {self.time_map!r}")
        if self.time_table_t or self.time_table_tau:
            check_knots(self.time_table_t, self.time_table_tau)
        if self.state_input not in STATE_INPUTS:
            raise ValueError(f"state_input must be one of {STATE_INPUTS}, got {self.state_input!r}")
        self._check_target()
        return self

    # ---------------------------------------------------------------- JSON (to_dict / from_dict: TargetRefConfig)
    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        return super().from_dict({**LEGACY_DEFAULTS, **d})

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("drafter config is not a JSON object")
        return cls.from_dict(d)
