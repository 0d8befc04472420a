"""Multi-step decoding inside one verify call: a row with next_seeds decodes that many more
tokens after its forward pass, each step an ordinary one-token forward of the rows still
stepping, fed the token the step before produced (argmax at T = 0, the residual sample
otherwise), so the call returns what as many separate calls would.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flashmap.types import VerifyResult, VerifyRow
from target_service.kept_features import join_features

_LOGPROBS = ("logprobs", "top_ids", "top_logprobs")  # VerifyResult's, one row per step


def decode_more(
    forward: Callable[[list[VerifyRow]], list[VerifyResult]],
    length: list[int],
    rows: list[VerifyRow],
    out: list[VerifyResult],
    more: list[int],
) -> list[VerifyResult]:
    """The further steps of the rows in `more` (next_seeds) after their pass gave `out`:
    forward(rows) is the engine's pass, length its slots' current lengths; each row's
    results are joined into one VerifyResult."""
    parts = {i: [out[i]] for i in more}
    for j in range(max(len(rows[i].next_seeds) for i in more)):
        live = [i for i in more if j < len(rows[i].next_seeds)]
        step = []
        for i in live:
            r, last = rows[i], parts[i][-1]
            token = last.decoded(r.params.greedy)[-1]
            step.append(
                VerifyRow(
                    r.slot,
                    length[r.slot],
                    np.array([token], np.int64),
                    r.params,
                    round_seed=int(r.next_seeds[j]),
                    features=r.features,
                    logprobs=r.logprobs,
                )
            )
        for i, res in zip(live, forward(step)):
            parts[i].append(res)
    for i, p in parts.items():
        out[i] = VerifyResult(
            np.concatenate([x.argmax for x in p]),
            p[0].support_probs,
            p[0].complement,
            np.concatenate([x.residual for x in p]),
            join_features([x.features for x in p]),
            *(np.concatenate([getattr(x, k) for x in p]) for k in _LOGPROBS),
        )
    return out
