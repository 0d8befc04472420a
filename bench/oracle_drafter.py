"""The drafter service around the oracle (drafter_service.oracle): over gRPC it drafts the
target's own greedy continuation of known prompts, so a benchmark through the stack knows the
acceptance it should see (the whole block, wherever the served target agrees with the
reference). bench.gpu_stack starts it beside the stack's own drafter.

    python -m bench.oracle_drafter --refs REFS.json --vocab V --port P --metrics-port M

REFS.json: a list of token-id lists, each prompt + the target's greedy output. The calls must
carry the drafter token of $FLASHMAP_DRAFTER_TOKEN when it is set, as the stack's drafter's do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from drafter_service.oracle import OracleProposer
    from drafter_service.server import DrafterService, serve
    from flashmap.auth import DRAFTER_TOKEN_ENV, read_secret
    from flashmap.logs import setup_logging

    ap = argparse.ArgumentParser(prog="python -m bench.oracle_drafter", description=__doc__)
    ap.add_argument("--refs", type=Path, required=True, help="JSON list of token-id lists")
    ap.add_argument("--vocab", type=int, required=True, help="the target's vocabulary size")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    a = ap.parse_args(argv)
    setup_logging("INFO")
    proposer = OracleProposer(json.loads(a.refs.read_text()), vocab_size=a.vocab)
    service = DrafterService(proposer, name="oracle")
    asyncio.run(
        serve(service, a.host, a.port, a.metrics_port, token=read_secret(DRAFTER_TOKEN_ENV))
    )


if __name__ == "__main__":
    main()
