"""Generated gRPC code (proto/flashmap/v1/*.proto); regenerate with `python proto/generate.py`."""
