"""Drafter part: FlashMap DiT, the DFlash-style baseline, proposers and the gRPC drafter service."""
