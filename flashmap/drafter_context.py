"""What the drafter holds of one sequence's context, and what it still has to be sent.

The drafter's context is every committed position strictly before the anchor, as token ids
and the target's features. Committed positions the drafter has not acknowledged wait in
`pending`; a call's answer acknowledges what that call sent, so a lost answer is sent again
from `seen`. Rows that went without features (the speculation controller lets rows of a
sequence that does not draft for now skip them) leave a gap: the sequence drafts again only
after a row has fetched the missing features from the target (VerifyRow.features_from).

Numpy only.
"""

from __future__ import annotations

import numpy as np


class DrafterContext:
    def __init__(self):
        self.pending: list[tuple[np.ndarray, object]] = []  # (ids [m], features [m, F]) pieces
        self.seen = 0  # positions the drafter has acknowledged
        self.lost = False  # the drafter lost this context: the sequence decodes without drafts
        self._gap: int | None = None  # first position a row without features left out

    @property
    def known(self) -> int:
        """Positions whose features the drafter holds or `pending` has."""
        return self.seen + sum(len(ids) for ids, _ in self.pending)

    @property
    def gap(self) -> int | None:
        """The first committed position whose features neither the drafter nor `pending` has,
        or None when the context is whole."""
        return self._gap

    def unsent(self) -> tuple[int, np.ndarray, list] | None:
        """(position of the first unacknowledged token, ids [m], features as a list of row
        pieces), or None when the drafter has everything. The pieces are what the target
        handed back (numpy, or the in-process engine's device tensors), joined where they are
        used: on the wire or on the drafter's device."""
        if not self.pending:
            return None
        ids = np.concatenate([ids for ids, _ in self.pending])
        return self.seen, ids, [f for _, f in self.pending]

    def acknowledged(self, n: int | None = None) -> None:
        """The drafter holds the first n pending positions (None: all). Rounds may have
        committed more while the call was out (a shadow probe's call runs beside them)."""
        held = sum(len(ids) for ids, _ in self.pending)
        n = held if n is None else min(n, held)
        self.seen += n
        rest = []
        for ids, feats in self.pending:
            if n >= len(ids):
                n -= len(ids)
                continue
            rest.append((ids[n:], feats[n:]))
            n = 0
        self.pending = rest

    def lose(self) -> None:
        """The drafter cannot serve this sequence any more."""
        self.lost = True
        self.pending.clear()

    def add(self, since: int, ids: np.ndarray, features) -> None:
        """Committed positions since..since+len(ids) with their features. Features that do not
        continue the context (a row fetched from elsewhere) are never drafted on: the context
        is lost."""
        if self.lost:
            return
        if since != self.known:
            self.lose()
            return
        self.pending.append((ids, features))
        self._gap = None

    def skipped(self) -> None:
        """A committed row went without features: the context has a gap from here on."""
        if self._gap is None:
            self._gap = self.known
