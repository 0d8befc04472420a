"""The orchestrator's options: each one a field here, its flag and environment variable made
from it (flashmap.config); `python -m orchestrator.server --help` lists them."""

from __future__ import annotations

from dataclasses import dataclass

from flashmap.auth import API_KEY_ENV, DRAFTER_TOKEN_ENV, TARGET_KEY_ENV
from flashmap.config import Config, at_least, in_range, option
from flashmap.drafts import TOP_M
from flashmap.rounds import DEFAULT_TREE_SAMPLING, TREE_SAMPLING
from flashmap.types import MAX_PLAIN_TOKENS, PLAIN_TOKENS, check_tree_blocks
from orchestrator.admission import BurstConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class OrchestratorConfig(Config):
    # Where it listens and what it talks to
    host: str = option("127.0.0.1", "address of the public APIs", env="FLASHMAP_HOST")
    port: int = option(50051, "gRPC Generate", env="FLASHMAP_PORT", check=at_least(0))
    http_port: int = option(
        8080,
        "the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions); 0 = off",
        env="FLASHMAP_HTTP_PORT",
        check=at_least(0),
    )
    metrics_port: int = option(
        9400, "Prometheus /metrics; 0 = off", env="FLASHMAP_METRICS_PORT", check=at_least(0)
    )
    target_url: str = option("127.0.0.1:8001", "Triton's gRPC address", env="FLASHMAP_TARGET_URL")
    target_model: str = option("flashmap_target", "the target's name in Triton's repository")
    drafter_url: str = option(
        "127.0.0.1:50052",
        "the drafter service; '' = none (the target decodes alone)",
        env="FLASHMAP_DRAFTER_URL",
    )
    tokenizer_dir: str | None = option(
        None,
        "the target checkpoint's tokenizer (text prompts, chat, stop strings; never its weights)",
        env="FLASHMAP_TARGET_DIR",
    )
    # Admission
    max_concurrent: int = option(0, "requests in rounds at once; 0 = the target's KV slots")
    max_queue: int = option(
        256,
        "requests waiting beyond max_concurrent; more are refused (RESOURCE_EXHAUSTED)",
        env="FLASHMAP_MAX_QUEUE",
        check=at_least(0),
    )
    # Requests sent together start in one round (orchestrator.admission).
    burst_window_s: float = option(
        BurstConfig.window_s,
        "waking from idle into requests sent together, wait up to this long for the rest of them "
        "so they prefill in one round (0 = start at once)",
        flag="--burst-window-ms",
        env="FLASHMAP_BURST_WINDOW_MS",
        scale=1e-3,
        check=at_least(0),
    )
    burst_gap_s: float = option(
        BurstConfig.gap_s,
        "requests closer than this are one burst; the wait ends after this long without one",
        flag="--burst-gap-ms",
        env="FLASHMAP_BURST_GAP_MS",
        scale=1e-3,
        check=at_least(0),
    )
    # Rounds
    speculation: str = option(
        "auto",
        "auto: each round's draft lengths from measured acceptance and costs "
        "(flashmap.speculation); full: always the whole block",
        env="FLASHMAP_SPECULATION",
        choices=("auto", "full"),
    )
    plain_tokens: int = option(
        PLAIN_TOKENS,
        "tokens per request of a round without drafts, decoded in one call to the target "
        "(its fixed cost paid once for them)",
        env="FLASHMAP_PLAIN_TOKENS",
        check=in_range(1, MAX_PLAIN_TOKENS),
    )
    pipeline: bool = option(
        True,
        "queue the next round without drafts at Triton while one runs (flashmap.rounds.Ahead), "
        "and probe greedy requests beside it",
        env="FLASHMAP_PIPELINE",
    )
    tree_blocks: int = option(
        1,
        "blocks drafted from independent noise per round and verified as one tree, for "
        "requests without their own tree_blocks (a drafter with a tree of its own drafts one)",
        env="FLASHMAP_TREE_BLOCKS",
        check=check_tree_blocks,
    )
    tree_sampling: str = option(
        DEFAULT_TREE_SAMPLING,
        "how a request's blocks at temperature > 0 are verified: rejection (each block a "
        "chain with its proposal law, multi-draft rejection sampling; on the dev prompts it "
        "accepts more than pick for 5 of 6 trees of 2-8 blocks), pick (the target picks its "
        "own token at each node of the merged tree and follows it) or siblings (rejection with "
        "each drafted token's other top-m tokens beside it as leaves; also for one block)",
        env="FLASHMAP_TREE_SAMPLING",
        choices=TREE_SAMPLING,
    )
    sibling_depth: int = option(
        0,
        "--tree-sampling siblings: leaves beside the drafted tokens of the first N depths only "
        "(0: every depth; 1: a verify of K + m - 1 tokens for most of the gain where drafts "
        "break early)",
        env="FLASHMAP_SIBLING_DEPTH",
        check=at_least(0),
    )
    top_m: int = option(
        TOP_M,
        "the drafter's support size per slot at temperature > 0 (with --tree-sampling siblings: "
        "the tokens beside each drafted one, plus one)",
        env="FLASHMAP_TOP_M",
        check=at_least(1),
    )
    draft_timeout_s: float = option(
        2.0,
        "a round waits this long for its drafts, then decodes without them",
        env="FLASHMAP_DRAFT_TIMEOUT_S",
        check=at_least(0),
    )
    target_timeout_s: float = option(
        30.0, "deadline of every call to Triton", env="FLASHMAP_TARGET_TIMEOUT_S", check=at_least(0)
    )
    resume_timeout_s: float = option(
        120.0,
        "a request whose target died waits this long (at most its deadline) for it to come "
        "back and continues on it; then it ends UNAVAILABLE",
        env="FLASHMAP_RESUME_TIMEOUT_S",
        check=at_least(0),
    )
    health_interval_s: float = option(
        2.0, "idle: probe the target this often (busy: the verify calls tell)", check=at_least(0.01)
    )
    # Trust boundaries (docs/ARCHITECTURE.md): secrets from the environment (flashmap.auth), "" = none.
    api_key: str = option(
        "",
        "clients must send authorization: Bearer <key> (Health and grpc.health stay open)",
        env=API_KEY_ENV,
        secret=True,
    )
    target_key: str = option(
        "", "Triton's restricted-protocol key", env=TARGET_KEY_ENV, secret=True
    )
    drafter_token: str = option(
        "", "the drafter's shared token", env=DRAFTER_TOKEN_ENV, secret=True
    )
    tls_cert: str | None = option(None, "PEM certificate chain: serve TLS", env="FLASHMAP_TLS_CERT")
    tls_key: str | None = option(None, "PEM private key of --tls-cert", env="FLASHMAP_TLS_KEY")
    reflection: bool = option(False, "serve gRPC reflection (off: less to probe)")
    max_message_bytes: int = option(
        4 << 20, "public API messages", env="FLASHMAP_MAX_MESSAGE_BYTES", check=at_least(1024)
    )
    max_prompt_bytes: int = option(
        1 << 20,
        "text prompts, refused before tokenising",
        env="FLASHMAP_MAX_PROMPT_BYTES",
        check=at_least(1),
    )
    max_request_id_len: int = option(128, "client-chosen request ids", check=at_least(1))
    log_level: str = option("INFO", "logging level", env="FLASHMAP_LOG_LEVEL")

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    @property
    def tls(self) -> tuple[str, str] | None:
        """(certificate chain, private key) files for the public ports, or None."""
        return (self.tls_cert, self.tls_key) if self.tls_cert else None
