"""`flashmap generate --in-process`: output, stats, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from drafter_service.checkpoint import init_drafter, save_drafter
from flashmap_cli.main import main
from target_service.random_checkpoint import make_random_qwen3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = make_random_qwen3(root / "target", max_position_embeddings=128)
    other = make_random_qwen3(
        root / "other", seed=1, max_position_embeddings=128
    )  # same shapes, other weights
    small = make_random_qwen3(root / "small-vocab", vocab_size=300, max_position_embeddings=128)
    drafter = save_drafter(init_drafter(target, dim=64, n_blocks=1, n_heads=4), root / "drafter")
    return {
        "target": str(target),
        "other": str(other),
        "small": str(small),
        "drafter": str(drafter),
        "root": root,
    }


def _run(capsys, *args):
    code = main(["generate", "--in-process", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_generate_json_ar_and_speculative_agree(ckpts, capsys):
    base = [
        "--target",
        ckpts["target"],
        "--prompt-ids",
        "5,6,7,8",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ]
    code, out, _ = _run(capsys, *base, "--ar")
    assert code == 0
    ar = json.loads(out)
    for steps in ("1", "2"):
        code, out, _ = _run(capsys, *base, "--drafter", ckpts["drafter"], "--draft-steps", steps)
        assert code == 0
        spec = json.loads(out)
        assert spec["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 12
        assert spec["mode"] == "speculative" and spec["drafts"] > 0
        assert len(spec["accepted_per_slot"]) == 16 and spec["mean_acceptance_length"] >= 1.0
    code, out, _ = _run(capsys, *base, "--drafter", ckpts["drafter"], "--tree-blocks", "3")
    assert code == 0 and json.loads(out)["token_ids"] == ar["token_ids"]
    sampled = [*base, "--temperature", "0.8", "--seed", "4", "--drafter", ckpts["drafter"]]
    outs = [_run(capsys, *sampled, "--tree-blocks", "3") for _ in range(2)]
    assert all(code == 0 for code, _, _ in outs)
    assert json.loads(outs[0][1])["token_ids"] == json.loads(outs[1][1])["token_ids"]  # seeded
    siblings = [*sampled, "--tree-sampling", "siblings", "--top-m", "3"]
    outs = [json.loads(_run(capsys, *siblings)[1]) for _ in range(2)]
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    # a block of at most 16 drafted tokens, each with its 2 other support tokens beside it
    assert outs[0]["draft_tokens"] > 16 * outs[0]["drafts"]
    first = json.loads(_run(capsys, *siblings, "--sibling-depth", "1")[1])
    # the same blocks with 2 leaves beside their first token only
    per_draft = first["draft_tokens"] / first["drafts"]
    assert per_draft <= 18 and per_draft < outs[0]["draft_tokens"] / outs[0]["drafts"]
    code, out, _ = _run(capsys, *base, "--drafter", ckpts["drafter"], "--min-confidence", "0.5")
    assert code == 0 and json.loads(out)["token_ids"] == ar["token_ids"]
    code, out, _ = _run(capsys, *base, "--drafter", ckpts["drafter"], "--compile")
    assert code == 0 and json.loads(out)["token_ids"] == ar["token_ids"]


def test_in_process_options_need_in_process(capsys):
    for opt in (["--compile"], ["--min-confidence", "0.2"], ["--tree-sampling", "siblings"]):
        assert main(["generate", "--prompt-ids", "1,2", *opt]) == 2
        assert "--in-process options" in capsys.readouterr().err


def test_text_prompt_prints_text(ckpts, capsys):
    code, out, err = _run(
        capsys,
        "--target",
        ckpts["target"],
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0.9",
        "--seed",
        "3",
    )
    assert code == 0 and out.strip() != ""
    assert "mean acceptance length" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt-ids", ""], "prompt is empty"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt-ids", ",".join(["1"] * 200)], "context"),
        (["--prompt-ids", "1,2,999999"], "outside the vocabulary"),
        (["--prompt-ids", "1,-3"], "outside the vocabulary"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens must be > 0"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "-4"], "max_new_tokens must be > 0"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "500"], "exceeds the context"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1,2", "--tree-blocks", "0"], "tree_blocks must be in 1..64"),
        (["--prompt-ids", "1,2", "--min-confidence", "1.5"], "--min-confidence: must be in [0, 1)"),
    ],
)
def test_bad_input_is_one_line(ckpts, capsys, args, message):
    code, out, err = _run(capsys, "--target", ckpts["target"], *args)
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_drafter_for_another_target(ckpts, capsys):
    # Same shapes, other embedding: the hash check must catch it.
    code, _, err = _run(
        capsys, "--target", ckpts["other"], "--drafter", ckpts["drafter"], "--prompt-ids", "1,2"
    )
    assert code == 2 and "error: " in err and err.count("\n") == 1
    # Other vocabulary: a shape mismatch.
    code, _, err = _run(
        capsys, "--target", ckpts["small"], "--drafter", ckpts["drafter"], "--prompt-ids", "1,2"
    )
    assert code == 2 and "error: " in err and err.count("\n") == 1


def test_missing_and_corrupt_checkpoints(ckpts, capsys, tmp_path):
    code, _, err = _run(capsys, "--target", str(tmp_path / "nope"), "--prompt-ids", "1,2")
    assert code == 2 and "config.json" in err and err.count("\n") == 1
    code, _, err = _run(
        capsys,
        "--target",
        ckpts["target"],
        "--drafter",
        str(tmp_path / "nope"),
        "--prompt-ids",
        "1,2",
    )
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    import shutil

    bad = tmp_path / "corrupt-target"
    shutil.copytree(ckpts["target"], bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    code, _, err = _run(capsys, "--target", str(bad), "--prompt-ids", "1,2")
    assert code == 2 and "model.safetensors" in err and err.count("\n") == 1
    badd = tmp_path / "corrupt-drafter"
    shutil.copytree(ckpts["drafter"], badd)
    (badd / "config.json").write_text("{not json")
    code, _, err = _run(
        capsys, "--target", ckpts["target"], "--drafter", str(badd), "--prompt-ids", "1,2"
    )
    assert code == 2 and "config.json" in err and err.count("\n") == 1


@pytest.mark.slow
def test_process_exit_status_and_no_traceback(ckpts):
    """The real console entry point: non-zero exit, one line, no traceback."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashmap_cli.main",
            "generate",
            "--in-process",
            "--target",
            ckpts["target"],
            "--prompt-ids",
            "1,2",
            "--temperature",
            "-2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: temperature must be >= 0, got -2.0"]


def test_chat_prompt_goes_through_the_chat_template(ckpts, capsys):
    """--chat renders the prompt as a user turn of the checkpoint's template: the same tokens as
    sending the rendered ids by hand; --chat / --system misuse is a one-line error."""
    from flashmap.tokenizer import TextTokenizer

    tok = TextTokenizer(ckpts["target"])
    ids = tok.encode(
        tok.render_chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
    )
    base = ["--target", ckpts["target"], "--max-new-tokens", "6", "--ignore-eos", "--json", "--ar"]
    code, out, _ = _run(capsys, *base, "--chat", "--system", "Be brief.", "--prompt", "hi")
    assert code == 0
    chat = json.loads(out)
    code, out, _ = _run(capsys, *base, "--prompt-ids", ",".join(map(str, ids)))
    assert (
        code == 0
        and json.loads(out)["token_ids"] == chat["token_ids"]
        and len(chat["token_ids"]) == 6
    )
    # ChatML neither thinks nor renders tools; log-probabilities come with the ids.
    assert chat["thinking"] == "unsupported" and chat["tool_calls"] == []
    code, out, _ = _run(
        capsys, *base, "--chat", "--prompt", "hi", "--logprobs", "--top-logprobs", "2"
    )
    got = json.loads(out)
    assert code == 0 and [x["token"] for x in got["logprobs"]] == got["token_ids"]
    assert all(len(x["top_ids"]) == 2 and x["logprob"] <= 0 for x in got["logprobs"])
    tool = '{"type": "function", "function": {"name": "f"}}'
    for args, message in (
        (["--chat", "--prompt-ids", "1,2"], "--chat takes a text prompt"),
        (["--system", "x", "--prompt", "hi"], "--system goes with --chat"),
        (["--prompt", "hi", "--tools", tool], "--tools and --tool-choice go with --chat"),
        (["--chat", "--prompt", "hi", "--tools", tool], "does not render tools"),
        (["--chat", "--prompt", "hi", "--top-logprobs", "2"], "top_logprobs needs logprobs"),
    ):
        code, _, err = _run(capsys, "--target", ckpts["target"], *args)
        assert code == 2 and message in err and err.count("\n") == 1


def test_stats_report_is_readable():
    from flashmap.types import SpecStats
    from flashmap_cli.main import stats_report

    s = SpecStats(block_size=4)
    s.record_round(4, 2)
    s.record_round(4, 4)
    s.record_round(0, 0)
    s.draft_steps, s.fallback_rounds = 1, 1
    text = stats_report("stack", 9, "stop", s, 0.5, 0.012)
    assert text.splitlines() == [
        "[stack] 9 tokens in 0.50 s (18.0 tokens/s), finish: stop, first token after 12 ms",
        "  mean acceptance length 4.00 tokens per drafted round: 6 of 8 draft tokens accepted in 2 drafted rounds "
        "(3 rounds in all, 1 flow-map step)",
        "  accepted / reached, by draft slot: 1: 2/2  2: 2/2  3: 1/2  4: 1/1",
        "  fallback rounds (drafter down or late, the target decoded alone): 1",
    ]
    assert "no drafts: 0 rounds" in stats_report("in-process", 1, "length", SpecStats(), 0.1)


def test_up_refuses_ports_another_server_holds(capsys, tmp_path):
    """A second `flashmap up` on the ports of a running one would find that one's parts healthy
    and say it is up: it stops at once with one line naming the port, nothing started."""
    import socket

    from flashmap_cli.stack import PortsInUse, Stack, StackConfig

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        stack = Stack(StackConfig.on_free_ports(target_dir=str(tmp_path), metrics_port=port))
        with pytest.raises(PortsInUse, match=f"127.0.0.1:{port} \\(metrics_port\\) in use"):
            stack.start()
        assert stack.triton is None and stack.drafter_proc is None and stack.orch_proc is None
        assert main(["up", "--port", str(port)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith("flashmap up: ")
            and f":{port} (port) in use" in err[0]
        )
