"""Records that cross part boundaries: a generation request and its statistics, target
verify rows / results, drafter requests and drafts.

Numpy only (no torch): every part imports these. Shapes use
K = number of draft tokens in a round (0 for prefill and autoregressive steps),
S = size of the drafter's explicit proposal support per slot, L = input tokens,
F = concatenated feature-layer width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BLOCK_SIZE = 16  # draft tokens per block (K): the paper's, and every drafter's default
# The limits every entry point enforces (check_draft_steps / GenerationRequest.validate at the
# edge: gRPC Generate, the OpenAI API, the CLI, the drafter's Draft stream and SetSteps, the
# services' configs); the parts behind an edge trust them.
# The clean-block estimate a flow state carries between steps: the denoiser's softmax (the
# flow) or its one-hot argmax (mode-seeking T = 0 drafting).
ESTIMATES = ("soft", "argmax")
DRAFT_STEPS = 1  # flow-map jumps per draft unless a request or SetSteps says (the paper's one jump)
MAX_DRAFT_STEPS = 64  # more Euler steps of the teacher than this are a mistake, not a request
PLAIN_TOKENS = (
    16  # tokens per request of a serving round without drafts (orchestrator --plain-tokens)
)
MAX_PLAIN_TOKENS = (
    64  # tokens one verify row may decode (VerifyRow.next_seeds): bounds a call's time
)
# A row whose tokens are [FOLLOW_TOKEN] continues its sequence with the last token the
# target decoded for it: a round sent before the round it follows has answered.
FOLLOW_TOKEN = -1
# The start of the target's INVALID_ARGUMENT message for a continuation that does not follow
# (it may have overtaken the round it follows: flashmap.rounds sends it again with its token).
FOLLOW_REFUSED = "a continuation (TOKENS [-1]) follows"


class InvalidRequest(ValueError):
    """Bad user input; servers map it to INVALID_ARGUMENT, the CLI to a one-line error."""


class TargetLost(ConnectionError):
    """A verify that never reached a live target (its process died or restarted, or cannot be
    reached): the target holds nothing of the rows' sequences any more, and they commit nothing
    (Sequence.rewind); they may resume once it is back (orchestrator.resume)."""


def check_draft_steps(n: int) -> int:
    """n as a step count of the flow-map drafter (1 or 2 jumps, or N Euler steps of the teacher),
    or InvalidRequest: the one check of draft_steps, wherever it comes in."""
    if not (isinstance(n, (int, np.integer)) and 1 <= n <= MAX_DRAFT_STEPS):
        raise InvalidRequest(f"draft_steps must be in 1..{MAX_DRAFT_STEPS}, got {n}")
    return n


MAX_TREE_BLOCKS = 64  # blocks from independent noise in one tree: bounds a verify row's size


def check_tree_blocks(n: int) -> int:
    """n as the number of blocks a round drafts from independent noise and verifies as one
    tree (1: a single block), or InvalidRequest."""
    if not (isinstance(n, (int, np.integer)) and 1 <= n <= MAX_TREE_BLOCKS):
        raise InvalidRequest(f"tree_blocks must be in 1..{MAX_TREE_BLOCKS}, got {n}")
    return n


def check_max_draft_tokens(n: int) -> int:
    """n as a cap on the draft tokens of a round (above the block size: the whole block), or
    InvalidRequest."""
    if not (isinstance(n, (int, np.integer)) and n >= 0):
        raise InvalidRequest(f"max_draft_tokens must be >= 0 (0 = speculation off), got {n}")
    return n


# The checks of a request's sampling settings: SamplingParams.validate and the fields of
# flashmap.request_options.RequestOptions run these, so every entry point refuses a value with
# the same message.


def check_max_new_tokens(n: int) -> int:
    if not n > 0:
        raise InvalidRequest(f"max_new_tokens must be > 0, got {n}")
    return n


def check_temperature(t: float) -> float:
    if not np.isfinite(t) or t < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {t}")
    return t


def check_top_k(k: int) -> int:
    """0 and -1 (vLLM's and OpenAI clients' spelling) are both "off"."""
    if not -1 <= k < 2**31:
        raise InvalidRequest(f"top_k must be in [-1, 2^31) (0 or -1 = off), got {k}")
    return k


def check_top_p(p: float) -> float:
    if not (0.0 < p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {p}")
    return p


def check_seed(seed: int) -> int:
    if not 0 <= seed < 2**64:  # numpy's generator seeds; the wire's uint64
        raise InvalidRequest(f"seed must be in [0, 2**64), got {seed}")
    return seed


MAX_TOP_LOGPROBS = 20  # alternatives per generated token (OpenAI's limit)


def check_top_logprobs(n: int) -> int:
    if not (isinstance(n, (int, np.integer)) and 0 <= n <= MAX_TOP_LOGPROBS):
        raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {n}")
    return n


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        check_temperature(self.temperature)
        check_top_k(self.top_k)
        check_top_p(self.top_p)
        if self.seed is not None:
            check_seed(self.seed)
        return self


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    draft_steps: int | None = None  # None: the drafter's current step count
    request_id: str = ""
    max_draft_tokens: int | None = None  # None: the drafter's block size; 0: speculation off
    tree_blocks: int | None = None  # None: the server's (flashmap.round_metadata)
    # The target's log-probability of each generated token and of the n most likely tokens at
    # its position (n = logprobs; None: none). Rows of this request ask the verify pass for them.
    logprobs: int | None = None
    # A conversation's output format (flashmap.chat.ChatFormat: thinking, tool calls); None:
    # the text is read as it is.
    chat: object = None

    def validate(self, vocab_size: int, max_seq_len: int) -> None:
        """Raise InvalidRequest with a one-line message for anything a server must refuse."""
        if len(self.prompt_ids) == 0:
            raise InvalidRequest("prompt is empty")
        bad = [t for t in self.prompt_ids if not (0 <= int(t) < vocab_size)]
        if bad:
            raise InvalidRequest(
                f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
        check_max_new_tokens(self.max_new_tokens)
        if len(self.prompt_ids) >= max_seq_len:
            raise InvalidRequest(
                f"prompt has {len(self.prompt_ids)} tokens; the context holds {max_seq_len}"
            )
        if len(self.prompt_ids) + self.max_new_tokens > max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(self.prompt_ids)}) + max_new_tokens ({self.max_new_tokens})"
                f" exceeds the context ({max_seq_len})"
            )
        if self.draft_steps is not None:
            check_draft_steps(self.draft_steps)
        if self.max_draft_tokens is not None:
            check_max_draft_tokens(self.max_draft_tokens)
        if self.tree_blocks is not None:
            check_tree_blocks(self.tree_blocks)
        if self.logprobs is not None:
            check_top_logprobs(self.logprobs)
        self.params.validate()


@dataclass
class SpecStats:
    """Speculation statistics of one request: THE record (in-process results, the orchestrator,
    the wire's SpecStats message and the client SDK all carry this one).

    Per slot k (0-based): drafted_per_slot[k] rounds drafted slot k; verified_per_slot[k] of
    them reached it (slots < k all accepted); accepted_per_slot[k] accepted it. So
    accepted / verified is the conditional acceptance P(slot k accepted | slots < k accepted).
    """

    block_size: int = BLOCK_SIZE
    rounds: int = 0  # verify passes after prefill
    drafts: int = 0  # rounds that verified a draft
    draft_tokens: int = 0
    accepted: int = 0
    fallback_rounds: int = (
        0  # rounds that wanted a draft and decoded without one (drafter down, late, lost)
    )
    draft_steps: int = 0  # step count of the latest drafted block
    draft_s: float = 0.0  # time in draft calls of the rounds this request took part in
    verify_s: float = 0.0  # time in verify calls of those rounds
    drafted_per_slot: np.ndarray = None  # [block_size] int64
    verified_per_slot: np.ndarray = None  # [block_size] int64
    accepted_per_slot: np.ndarray = None  # [block_size] int64

    def __post_init__(self):
        for name in ("drafted_per_slot", "verified_per_slot", "accepted_per_slot"):
            v = getattr(self, name)
            arr = np.zeros(self.block_size, np.int64) if v is None else np.asarray(v, np.int64)
            if len(arr) < self.block_size:
                arr = np.concatenate([arr, np.zeros(self.block_size - len(arr), np.int64)])
            setattr(self, name, arr)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per drafted round (gamma), ARCHITECTURE.md's definition."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    def record_round(self, drafted: int, accepted: int, tokens: int | None = None) -> None:
        """One verified round of `drafted` draft slots (a chain's length, a tree's depth), the
        first `accepted` of them accepted; tokens: the tokens verified (a tree's nodes;
        default drafted)."""
        self.rounds += 1
        if not drafted:
            return
        self.drafts += 1
        self.draft_tokens += drafted if tokens is None else tokens
        self.accepted += accepted
        self.drafted_per_slot[:drafted] += 1
        self.verified_per_slot[: min(drafted, accepted + 1)] += 1
        self.accepted_per_slot[:accepted] += 1

    def conditional_acceptance(self) -> np.ndarray:
        """[block_size] P(slot k accepted | slots < k accepted, slot k drafted); NaN where never reached."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(
                self.verified_per_slot > 0,
                self.accepted_per_slot / np.maximum(self.verified_per_slot, 1),
                np.nan,
            )

    def as_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        for k, v in d.items():
            if isinstance(v, np.ndarray):
                d[k] = v.tolist()
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d


@dataclass
class VerifyRow:
    """One sequence's input to a target verify pass.

    tokens are written at positions start_pos .. start_pos+L-1 after the sequence's
    KV cache is truncated to start_pos. Statistics are returned for the last K+1
    positions, where K = len(support_ids): rows 0..K-1 check draft tokens
    tokens[L-K:], row K is the bonus position.

    next_seeds (rows without drafts only): the target decodes len(next_seeds) more tokens
    after this row in the same call, step j fed the token step j - 1 produced (argmax at
    T = 0, the residual sample otherwise) and seeded by next_seeds[j], exactly as that many
    more one-token rows with these round seeds would (multi-step decoding: one call, one
    round trip, for `steps` tokens).

    features False: the result's features are empty ([0, F]): a row of a sequence that will
    never draft (no drafter, speculation off for the request, the drafter's context lost), or
    that does not draft for now, needs none, and the target skips copying and sending them.

    features_from >= 0 (a target that keeps every position's features, as TargetEngine
    does): the result's features start at this earlier position of the sequence
    ([start_pos - features_from + L + steps - 1, F]), so a sequence whose rows went without
    features catches its drafter's context up in one row.

    logprobs >= 0: the result carries the raw log-probabilities (log-softmax of the logits,
    before temperature, top-k and top-p) of the tokens each position may commit, and the
    `logprobs` most likely tokens there (VerifyResult.logprobs); -1: none (no cost).

    parents (non-empty): the K drafted tokens are a tree, draft i a child of draft parents[i]
    (< i; -1: the anchor), verified in one pass with tree attention (target_service.tree). The
    target walks it and answers for the path of drafts it accepts, as if that path alone had
    been the row's draft: its argmax [a + 1] along it, at T > 0 its own tokens along it as
    `residual` [a + 1] (the last one: the token committed after the path), and features of the
    positions up to its end (its cache as after such a row), with the path's indices
    (`Target.verify`).
    """

    slot: int
    start_pos: int
    tokens: np.ndarray  # [L] int64
    params: SamplingParams
    support_ids: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 1), np.int64)
    )  # [K, S], -1 = padding
    round_seed: int = 0  # seeds the target's residual / bonus samples for this row
    next_seeds: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64)
    )  # [steps - 1] int64
    features: bool = True
    features_from: int = -1  # -1: features of this row's own positions only
    parents: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [K] for a tree
    # Tree rows at T > 0 only: the drafts' proposal law q over support_ids [K, S] (each draft
    # drawn from its own q given the drafter's randomness). Present: the target verifies the
    # tree by multi-draft rejection sampling with q; empty: it follows its own picks.
    support_q: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    logprobs: int = -1  # -1: no log-probabilities; n >= 0: with the top n per position

    @property
    def num_draft(self) -> int:
        return int(self.support_ids.shape[0])

    @property
    def is_tree(self) -> bool:
        return len(self.parents) > 0

    @property
    def steps(self) -> int:
        """Tokens this row decodes: 1 + len(next_seeds)."""
        return 1 + len(self.next_seeds)


@dataclass
class VerifyResult:
    """Per-position verification statistics (docs/ARCHITECTURE.md, exact sampling protocol). A row of
    `steps` > 1 (no drafts) gets argmax and residual [steps], one per decoded token, and
    features [L + steps - 1, F] (its tokens, then every decoded token but the last).

    A row that asks for log-probabilities (VerifyRow.logprobs = n >= 0) gets, per position,
    the raw log-probabilities of every token the position may commit: the support ids S_k
    (columns :S, -inf on padding and at the bonus position) and the target's own token there
    (the last column: `decoded`), so whatever rejection sampling commits, its log-probability
    is here; and the n most likely tokens with theirs. O(K * (S + n)) numbers; empty [0, 0]
    for a row that does not ask."""

    argmax: np.ndarray  # [K+1] int64, target argmax after the anchor and each draft token
    support_probs: np.ndarray  # [K, S] float32, p_k(s) for s in S_k (0 for padding); empty at T=0
    complement: np.ndarray  # [K] float32, c_k = 1 - sum_s p_k(s); empty at T=0
    residual: np.ndarray  # [K+1] int64, y_k ~ p_k outside S_k (row K: bonus ~ p_{K+1}); -1 if none
    features: np.ndarray  # [L, F] float32, feature-layer hidden states of every input position
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [K+1, S+1]
    top_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # [K+1, n]
    top_logprobs: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 0), np.float32)
    )  # [K+1, n]

    def decoded(self, greedy: bool) -> np.ndarray:
        """The target's own next token after each bonus position: its argmax at T = 0, its
        sample otherwise (what a row without drafts commits, one per step)."""
        return self.argmax if greedy else self.residual

    def token_logprob(self, j: int, token: int, support: np.ndarray, greedy: bool) -> TokenLogprob:
        """The committed `token` at verified position j (support: S_j, the row's support ids
        there, or empty) with its log-probability and position j's top tokens."""
        lp = self.logprobs[j]
        if token == int(self.decoded(greedy)[j]):
            value = lp[-1]
        else:
            hits = np.nonzero(np.asarray(support).reshape(-1) == token)[0]
            if not len(hits):
                raise ValueError(f"token {token} at position {j}: not a token the row could commit")
            value = lp[hits[0]]
        return TokenLogprob(
            int(token),
            float(value),
            self.top_ids[j].tolist(),
            self.top_logprobs[j].tolist(),
        )


@dataclass
class TokenLogprob:
    """A generated token with the target's raw log-probability of it at its position and the
    most likely tokens there (ids and log-probabilities, most likely first)."""

    token: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def feature_layers_for(num_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced layers from 1 to N-3 (36 layers -> 1, 9, 17, 25, 33).

    Layer l means the output of decoder layer l (0-based), i.e. HF hidden_states[l+1].
    Small targets get fewer, distinct layers.
    """
    hi = max(num_layers - 3, 0)
    lo = min(1, hi)
    return sorted({int(round(x)) for x in np.linspace(lo, hi, count)})
