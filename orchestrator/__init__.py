"""Orchestrator part: rejection sampling, per-sequence round logic, the Generate server, metrics.

Needs no torch: numpy, grpcio, tritonclient and prometheus-client only.
"""
