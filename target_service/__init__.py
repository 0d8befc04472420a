"""Target part: the Qwen3 engine (slot KV cache, batched verify) and its Triton model repository."""
