"""The architecture holds: the import contracts of pyproject.toml (import-linter), and the
orchestrator, the client SDK and the Triton client run without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    # In a subprocess: import-linter configures logging, which would silence this process' loggers.
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    out = subprocess.run(
        [sys.executable, "-c", code, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " 0 broken" in out.stdout


def test_orchestrator_client_and_triton_client_import_no_torch():
    modules = [
        "orchestrator.server",
        "orchestrator.target_client",
        "orchestrator.drafter_client",
        "flashmap.client",
        "flashmap.rounds",
        "flashmap.inprocess",
        "flashmap.wire",
        "flashmap.metrics",
        "flashmap.checkpoint",
        "flashmap.tokenizer",
    ]
    heavy = "('torch', 'transformers')"
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _over_500_lines_without_a_reason() -> list[str]:
    """Modules over 500 lines (outside tests and generated code) whose docstring does not say
    why they are one idea (a line starting "One idea:")."""
    import ast

    out = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[:2] == ("flashmap", "v1"):
            continue
        text = path.read_text()
        if text.count("\n") <= 500:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("One idea:") for line in doc.splitlines()):
            out.append(f"{rel} ({text.count(chr(10))} lines)")
    return out


def test_long_modules_say_why_they_are_one_idea():
    assert _over_500_lines_without_a_reason() == []


def test_ruff_format_and_check_pass():
    """`ruff format --check` and `ruff check` (configuration in pyproject.toml)."""
    for args in (["format", "--check", "."], ["check", "."]):
        out = subprocess.run(
            [sys.executable, "-m", "ruff", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, (
            f"ruff {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"
        )
