"""What the tests that run the real stack share: the tiny target and its in-process greedy
reference (checked for near-ties) as fixtures, /metrics readers, polling, and one torch
thread per process."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest


def _metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _samples(port: int) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(_metrics_text(port)) for s in fam.samples]


def _total(samples, name: str, **labels) -> float:
    """Sum of every sample called `name` whose labels include `labels`."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wait_until(what: str, fn, timeout_s: float = 30.0, interval_s: float = 0.1):
    """Call fn until it returns a truthy value, and return that; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})")


def _poll(what: str, fn, timeout_s: float = 20.0, interval_s: float = 0.05):
    """Call fn until it returns a truthy value; fail with `what` after timeout_s."""
    return wait_until(what, fn, timeout_s, interval_s)


class Reference:
    """Greedy reference outputs from the in-process autoregressive decoder, checked for near-ties."""

    def __init__(self, target_dir: Path):
        import torch
        from transformers import Qwen3ForCausalLM

        from target_service.engine import TargetEngine

        self.torch = torch
        self.engine = TargetEngine(target_dir, n_slots=16, max_seq_len=1024)
        self.hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.cache: dict[tuple, list[int]] = {}

    def __call__(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        from flashmap.inprocess import decode
        from flashmap.types import GenerationRequest, SamplingParams

        todo = list(
            dict.fromkeys(tuple(p) for p in prompts if (tuple(p), max_new) not in self.cache)
        )
        if todo:
            results = decode(
                self.engine,
                [GenerationRequest(list(p), max_new, SamplingParams()) for p in todo],
                proposer=None,
            )
            for p, r in zip(todo, results):
                assert r.finish_reason == "length" and len(r.token_ids) == max_new
                self._check_no_near_tie(list(p), r.token_ids)
                self.cache[(p, max_new)] = list(r.token_ids)
        return [self.cache[(tuple(p), max_new)] for p in prompts]

    def _check_no_near_tie(self, prompt: list[int], out: list[int]) -> None:
        torch = self.torch
        with torch.inference_mode():
            logits = self.hf(torch.tensor([prompt + out]), use_cache=False).logits[0]
        gen = logits[
            len(prompt) - 1 : len(prompt) + len(out) - 1
        ]  # the logits that chose each output token
        assert gen.argmax(-1).tolist() == out, "in-process decoder disagrees with transformers"
        top2 = torch.topk(gen, 2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        assert gap > 1e-4, f"near-tie in the reference (top-2 gap {gap:.2e}): pick other prompts"


VOCAB = 512


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with a tokenizer (the stack tests' target)."""
    from target_service.random_checkpoint import make_random_qwen3

    return make_random_qwen3(
        tmp_path_factory.mktemp("stack") / "tiny-qwen3", vocab_size=VOCAB, seed=3
    )


@pytest.fixture(scope="module")
def ref(target_dir) -> Reference:
    return Reference(target_dir)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_process():
    """Triton's model, the drafter and this process each run torch: with a thread per core in
    each, they spin against each other on a small machine and a round takes 10x longer."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("MKL_NUM_THREADS", "1")
        yield
