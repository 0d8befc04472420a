"""The documents hold together: every file in docs/results/ is referenced from the README or
another document, and every link to a file in the README and under docs/ points at one that
exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
# [text](target) in markdown, and `docs/...` in code spans (paths from the repository root).
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`(docs/[^`\s]+)`")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_result_file_is_referenced():
    """By its path from docs/results/ (or from the repository) in the README or any document,
    or by its name in a document of its own folder; a folder's README.md by the folder's name."""
    texts = {p: p.read_text() for p in markdown_files()}
    unreferenced = []
    for f in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = f.relative_to(RESULTS).as_posix()
        names = {rel, f"docs/results/{rel}"}
        if f.name == "README.md" and f.parent != RESULTS:
            names.add(f.parent.relative_to(RESULTS).as_posix() + "/")
        found = any(
            doc != f
            and (
                any(n in text for n in names)
                or (doc.parent == f.parent and re.search(rf"\b{re.escape(f.name)}\b", text))
            )
            for doc, text in texts.items()
        )
        if not found:
            unreferenced.append(rel)
    assert not unreferenced, f"docs/results files no document refers to: {unreferenced}"


def test_links_point_at_files_that_exist():
    broken = []
    for doc in markdown_files():
        text = doc.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: ({target})")
        for target in CODE_PATH.findall(text):
            if not (REPO / target.rstrip(".,;:")).exists():
                broken.append(f"{doc.relative_to(REPO)}: `{target}`")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_results_table_links_every_current_report():
    """Each report at the top of docs/results/ that a tool writes has a row in the table of
    docs/results/README.md, which the README links."""
    index = (RESULTS / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| [")]
    linked = {m.split("#")[0] for line in rows for m in LINK.findall(line.split("|")[1])}
    skip = {"README.md", "gpu_notes.md"}
    reports = {p.name for p in RESULTS.glob("*.md") if p.name not in skip}
    assert reports <= linked, f"reports without a row: {sorted(reports - linked)}"
    assert "docs/results/README.md" in (REPO / "README.md").read_text()


def test_the_readme_is_a_newcomers_page():
    """At most 150 lines, and no reference to a design outside the repository."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for doc in markdown_files():
        assert "shared/DESIGN" not in doc.read_text(), doc
