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
