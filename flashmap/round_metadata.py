"""A round as values: the plan made before anything is sent, the drafter's answer, and what
the round committed.

The speculation controller (flashmap.speculation) makes the plan from measured costs; without
a controller every sequence that can draft asks for its whole block (`plan_round`). The
drafter and target adapters read the plan; nothing of it is written on the sequences. The
controller learns from the RoundResult (SpeculationController.observe).

Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashmap.drafts import Draft, SeqId
from flashmap.sequence import Sequence

if TYPE_CHECKING:
    from flashmap.pipeline import Ahead


@dataclass(frozen=True)
class SeqPlan:
    """One sequence's part of a round."""

    draft: int = 0  # draft tokens to ask for (0: the row goes without a draft)
    blocks: int = 1  # blocks from independent noise, verified as one tree
    features: bool = False  # a row without a draft brings the drafter's features back


NO_DRAFT = SeqPlan()


@dataclass
class RoundPlan:
    seqs: dict[SeqId, SeqPlan]
    # Tokens per row when the round verifies no draft, or when its only draft is a probe the
    # others need not wait for (`probing`): one verify call decodes them all.
    plain_tokens: int = 1
    probing: bool = False
    shadow: dict[SeqId, int] = field(default_factory=dict)  # shadow probes: block lengths
    chosen: dict[SeqId, int] | None = None  # the controller's draft lengths (None: no controller)

    def of(self, s: Sequence) -> SeqPlan:
        return self.seqs.get(s.seq_id, NO_DRAFT)


def plan_round(
    seqs: list[Sequence], drafter: bool, blocks: int = 1, plain_tokens: int = 1
) -> RoundPlan:
    """The plan without a controller: every sequence that can draft asks for its whole block
    (its request's tree_blocks blocks, else `blocks`); drafter False: none drafts and no row
    brings features."""
    return RoundPlan(
        {
            s.seq_id: SeqPlan(
                s.draft_cap() if drafter else 0,
                s.request.tree_blocks or blocks,
                drafter and s.may_draft(),
            )
            for s in seqs
        },
        plain_tokens,
    )


@dataclass
class DraftBatch:
    """A drafter's answer for one round: blocks per sequence id (one block, a chain or a tree;
    several blocks are verified as one tree). Sequences asked and missing here draft nothing
    this round; `failure` says why when the whole call failed ("unavailable", "timeout")."""

    blocks: dict[SeqId, list[Draft]] = field(default_factory=dict)
    failure: str = ""
    asked: set[SeqId] = field(default_factory=set)  # the sequences the call carried
    lost: set[SeqId] = field(default_factory=set)  # planned to draft, but the context is lost
    seconds: float = 0.0


@dataclass
class SequenceRound:
    """One sequence's part of a round's result."""

    seq: Sequence
    new_tokens: list[int]  # committed this round (the first response token at prefill)
    prefill: bool
    drafted: int = 0  # draft tokens verified
    accepted: int = 0
    fallback: str = (
        ""  # why a sequence planned to draft had none: unavailable | timeout | context_lost
    )
    error: BaseException | None = None
    logprobs: list | None = None  # [len(new_tokens)] TokenLogprob, when the request asks


@dataclass
class RoundResult:
    plan: RoundPlan
    sequences: list[SequenceRound] = field(default_factory=list)
    row_lengths: list[int] = field(default_factory=list)  # query tokens of each verify row
    drafting: int = 0  # sequences the draft call carried
    draft_s: float = 0.0
    verify_s: float = 0.0
    rest_s: float = 0.0  # the round's seconds outside the draft call (verify, planning, commits)
    draft_steps: int = 0  # step count of this round's blocks (0: none drafted)
    plain_tokens: int = 1  # most tokens a row without a draft decoded in the verify call
    ahead: Ahead | None = None  # the next round, already sent (flashmap.pipeline)
    shadows: int = 0  # shadow probes started after this round
    # With a controller: the draft tokens it expected the drafted rows to accept (its estimate
    # before the verify) and what they did accept, over the rows verified without error.
    expected_accepted: float = 0.0
    accepted: int = 0

    @property
    def prefill(self) -> bool:
        return any(r.prefill for r in self.sequences)
