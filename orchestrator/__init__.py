"""Orchestrator part: the public Generate server, its clients of the target (Triton) and the
drafter service, and its Prometheus registry. Round logic and rejection sampling are the
core's (flashmap.rounds, flashmap.sequence).

Needs no torch: numpy, grpcio, tritonclient and prometheus-client only.
"""
