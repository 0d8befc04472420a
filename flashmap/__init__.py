"""FlashMap Serve: exact speculative decoding with a flow-map drafter.

This package holds what every part shares (typed request/result records, config) and
the user-facing pieces: the client SDK, the CLI and the in-process decoder.
"""

__version__ = "0.1.0"
