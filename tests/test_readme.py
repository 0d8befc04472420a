"""The README's examples, run as written against a stack serving the demo checkpoints
(checkpoints/demo-target + checkpoints/demo-flashmap-eq): every `flashmap generate` command,
the curl request, the Python snippets (the OpenAI client and the gRPC SDK) and the
in-process command. Each must give the answer the demo target is known to give (its chat
bank and code, at temperature 0, so the stack's output is the target's own), which keeps the
README's first results recognisable rather than empty.

Commands are taken from README.md itself: a new example without an expected answer here
fails the test, so the two cannot drift apart. `.venv/bin/flashmap` runs as
`python -m flashmap_cli.main` of this checkout, the addresses are the test stack's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmap_cli.stack import DEMO_DRAFTER, DEMO_TARGET, Stack, StackConfig
from tests.stack_helpers import one_thread_per_process  # noqa: F401 - autouse fixture

REPO_ROOT = Path(__file__).resolve().parent.parent
README = (REPO_ROOT / "README.md").read_text()

# What the demo target answers (its chat bank, and the Fibonacci loop of its coding tasks).
EXPECTED = {
    "What can you do?": "I can explain functions from the Python standard library, write small Python functions, "
    "and solve arithmetic and word problems step by step.",
    "Thanks a lot!": "You're welcome!",
    "def fibonacci(n)": "    for i in range(n):\n        a, b = b, a + b\n    return a\n",
}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)  # fences at a line start only


def _commands(block: str) -> list[str]:
    """Shell commands of a block, continuation lines joined."""
    return [
        c.strip()
        for c in block.replace("\\\n", " ").splitlines()
        if c.strip() and not c.startswith("#")
    ]


def _expected(text: str) -> str:
    hits = [answer for prompt, answer in EXPECTED.items() if prompt in text]
    assert len(hits) == 1, (
        f"README example without a known answer (add it to EXPECTED): {text[:120]!r}"
    )
    return hits[0]


def _env(**extra) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def _flashmap(cmd: str) -> str:
    return cmd.replace(".venv/bin/flashmap", f"{sys.executable} -m flashmap_cli.main")


def _run(cmd: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", cmd], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.unit
def test_readme_opens_with_exactly_two_setup_commands():
    first = _blocks("bash")[0]
    assert README.startswith(f"# FlashMap Serve\n\n```bash\n{first}```")
    assert [c.split("#")[0].strip() for c in _commands(first)] == [
        "bash scripts/run.sh",
        "bash scripts/test.sh",
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (DEMO_TARGET / "config.json").is_file() or not (DEMO_DRAFTER / "config.json").is_file():
        pytest.skip("demo checkpoints missing")
    cfg = StackConfig.on_free_ports(
        target_dir=str(DEMO_TARGET),
        drafter=str(DEMO_DRAFTER),
        n_slots=4,
        max_seq_len=1024,
        log_dir=str(tmp_path_factory.mktemp("logs-readme")),
    )
    with Stack(cfg) as st:
        yield st


def _stack_commands() -> list[str]:
    return [
        c
        for b in _blocks("bash")[1:]
        for c in _commands(b)
        if "flashmap generate" in c and "--in-process" not in c
    ]


@pytest.mark.timeout(300)
def test_generate_examples_answer_recognisably(stack):
    cmds = _stack_commands()
    assert cmds, "the README has no `flashmap generate` example"
    env = _env(FLASHMAP_URL=stack.cfg.url, FLASHMAP_DRAFTER_TOKEN=stack.cfg.drafter_token)
    for cmd in cmds:
        p = _run(_flashmap(cmd), env)
        assert p.returncode == 0, (cmd, p.stderr)
        want = _expected(cmd)
        if "--json" in cmd:
            out = json.loads(p.stdout)
            assert out["text"] == want and out["finish_reason"] == "stop"
            assert (
                len(out["token_ids"]) == out["completion_tokens"] > 0
            )  # the ids are carried, not dropped
            assert out["stats"]["rounds"] >= 1
        else:
            assert p.stdout.strip() == want, (cmd, p.stdout)
            # The acceptance statistics, readable, on stderr.
            assert "finish: stop" in p.stderr and "mean acceptance length" in p.stderr, p.stderr
            assert "accepted / reached, by draft slot: 1:" in p.stderr, p.stderr


@pytest.mark.timeout(300)
def test_generate_json_ids_are_the_target_alone(stack):
    """`--json` against the stack: the ids decode to the text and equal the demo target's own
    greedy output, decoded in process without a drafter."""
    from flashmap.inprocess import decode
    from flashmap.tokenizer import TextTokenizer
    from flashmap.types import GenerationRequest, SamplingParams
    from target_service.engine import TargetEngine

    p = _run(
        _flashmap(
            f".venv/bin/flashmap generate --chat 'What can you do?' --json --url {stack.cfg.url}"
        ),
        _env(),
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    tok = TextTokenizer(DEMO_TARGET)
    engine = TargetEngine(DEMO_TARGET, n_slots=1, max_seq_len=1024)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What can you do?"}]))
    (ref,) = decode(
        engine,
        [GenerationRequest(prompt, 64, SamplingParams(), tuple(engine.eos_token_ids))],
        proposer=None,
    )
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == tok.decode(ref.token_ids) == EXPECTED["What can you do?"]
    assert out["prompt_tokens"] == len(prompt)


@pytest.mark.timeout(120)
def test_curl_example_works_as_written(stack):
    cmds = [c for b in _blocks("bash") for c in _commands(b) if c.startswith("curl ")]
    assert cmds, "the README has no curl example of the OpenAI API"
    for cmd in cmds:
        assert "http://127.0.0.1:8080/v1/" in cmd
        cmd = cmd.replace("127.0.0.1:8080", f"127.0.0.1:{stack.cfg.http_port}")
        if shutil.which("curl"):
            p = _run(cmd, _env(), 60)
            assert p.returncode == 0, p.stderr
            body = json.loads(p.stdout)
        else:  # the same request without curl
            import shlex

            import httpx

            args = shlex.split(cmd)
            body = httpx.post(
                next(a for a in args if a.startswith("http")),
                json=json.loads(args[args.index("-d") + 1]),
                timeout=60,
            ).json()
        want = _expected(cmd)
        content = (
            body["choices"][0]["message"]["content"]
            if "/chat/" in cmd
            else body["choices"][0]["text"]
        )
        assert content == want, body
        assert body["usage"]["completion_tokens"] > 0 and body["flashmap"]["rounds"] >= 1


@pytest.mark.timeout(180)
def test_python_examples_work_as_written(stack):
    """The README's Python blocks (OpenAI client, gRPC SDK) with the test stack's addresses."""
    blocks = _blocks("python")
    assert blocks
    subs = {
        "127.0.0.1:8080": f"127.0.0.1:{stack.cfg.http_port}",
        "127.0.0.1:50051": stack.cfg.url,
        "127.0.0.1:50052": stack.cfg.drafter_url,
    }
    from flashmap.client import DrafterAdmin

    admin = DrafterAdmin(stack.cfg.drafter_url, token=stack.cfg.drafter_token)
    try:
        for block in blocks:
            code = block
            for a, b in subs.items():
                code = code.replace(a, b)
            env = _env(
                FLASHMAP_DRAFTER_TOKEN=stack.cfg.drafter_token
            )  # what `flashmap up` leaves for its user
            p = subprocess.run(
                [sys.executable, "-c", code],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 0, (block, p.stderr)
            assert _expected(block) in p.stdout, (block, p.stdout)
    finally:
        admin.set_steps(1)
        admin.close()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_in_process_example():
    (cmd,) = [c for b in _blocks("bash") for c in _commands(b) if "--in-process" in c]
    p = _run(_flashmap(cmd), _env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == _expected(cmd)
    assert "[speculative]" in p.stderr and "mean acceptance length" in p.stderr
