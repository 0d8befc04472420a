"""FlashMap Serve's core: what every part shares, with no torch.

Records of a request and a round, the per-request round state, rejection sampling, the
round loop and the in-process runtime over it, the wire codec, the metric catalogue,
checkpoint reading, gRPC / logging helpers, the tokenizer and the client SDK. The
services (target_service, drafter_service, orchestrator) import this package and nothing
of each other.
"""

__version__ = "0.1.0"
