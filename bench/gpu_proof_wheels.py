"""The GPU proof's wheels (scripts/gpu-proof.sh): what a GPU machine without a network lacks,
installed from the checkout's ignored `.whl/` folder, and the list of them to download
beforehand on a machine with PyPI.

    python -m bench.gpu_proof_wheels install [--wheels .whl]   (on the GPU machine)
    python -m bench.gpu_proof_wheels fetch-list                (names==versions to download)

install: every requirement of the project (pyproject.toml [project] dependencies, and the
`triton` extra when its wheel is there) that the running Python does not satisfy, with what
those wheels require in turn, is installed from .whl/ (pip --no-index --no-deps); a wheel built
for another Python or platform, or a requirement no wheel satisfies, is named with what to do.
Standard library and `packaging` only: it runs before anything is installed.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
# What the GPU image usually lacks, or holds in a version the generated gRPC code refuses
# (grpcio, protobuf): `fetch-list` pins them to this environment's versions, the ones tested.
USUALLY_MISSING = (
    "tritonclient",
    "python-rapidjson",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "uvicorn",
    "opentelemetry-api",  # fastapi's
    "importlib-metadata",  # opentelemetry-api's
)
# nvidia-pytriton (tritonserver and its Python backend) and what it needs beyond the image: its
# wheel is ~55 MB, more than the checkout can carry beside itself to a 64 MiB machine.
PYTRITON = ("nvidia-pytriton", "pyzmq", "sh")


def project_requirements(with_triton: bool) -> list[str]:
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"])
    if with_triton:
        reqs += proj["optional-dependencies"]["triton"]
    return reqs


def wheels_in(folder: Path) -> dict[str, tuple[str, Path, list[str], frozenset]]:
    """name -> (version, file, Requires-Dist lines, tags) of every wheel in the folder."""
    import zipfile

    out = {}
    for f in sorted(folder.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(f.name)
        with zipfile.ZipFile(f) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode(errors="replace").splitlines()
        requires = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
        out[canonicalize_name(name)] = (str(version), f, requires, frozenset(tags))
    return out


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan(
    folder: Path, requirements: list[str] | None = None
) -> tuple[list[Path], list[str], list[str]]:
    """(wheels to install, requirements nothing satisfies, wheels for another Python) for the
    requirements (default: the project's) and what their wheels require in turn."""
    wheels = wheels_in(folder) if folder.is_dir() else {}
    if requirements is None:
        requirements = project_requirements("nvidia-pytriton" in wheels)
    todo = [(r, ()) for r in requirements]
    here = set(sys_tags())
    chosen: dict[str, Path] = {}
    unmet, foreign, seen = [], [], set()
    while todo:
        text, extras = todo.pop()
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": e}) for e in (extras or ("",))
        ):
            continue
        name = canonicalize_name(req.name)
        key = (name, str(req.specifier), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        have = installed_version(name)
        if name not in chosen and have and req.specifier.contains(have, prereleases=True):
            continue
        if name not in wheels or not req.specifier.contains(wheels[name][0], prereleases=True):
            unmet.append(f"{req} (installed: {have or 'none'}; no wheel in {folder} satisfies it)")
            continue
        version, path, requires, tags = wheels[name]
        if not tags & here:
            if path.name not in foreign:
                foreign.append(path.name)
            continue
        if name not in chosen:
            chosen[name] = path
        todo += [(r, tuple(sorted(req.extras))) for r in requires]
    return list(chosen.values()), unmet, foreign


def install(folder: Path, dry_run: bool = False) -> int:
    paths, unmet, foreign = plan(folder)
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if foreign:
        print(
            f"gpu-proof: wheels in {folder} are for another Python or platform than this one "
            f"(Python {sys.version.split()[0]}, {py}): {', '.join(foreign)}.\n"
            f"  On a machine with PyPI: bash scripts/gpu-proof.sh --fetch-wheels --python-version "
            f"{sys.version_info.major}.{sys.version_info.minor}",
            flush=True,
        )
    if paths:
        names = ", ".join(p.name for p in paths)
        print(f"gpu-proof: installing from {folder}: {names}", flush=True)
        if dry_run:
            paths = []
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--disable-pip-version-check", *map(str, paths)]
        if paths and subprocess.run(cmd).returncode != 0:
            print("gpu-proof: pip install from the wheels failed", flush=True)
            return 1
    else:
        print("gpu-proof: every requirement is installed already", flush=True)
    for u in unmet:
        print(f"gpu-proof: unmet requirement: {u}", flush=True)
    return 0


def fetch_list(with_pytriton: bool) -> int:
    """name==version per line for the wheels to download: this environment's versions."""
    for name in USUALLY_MISSING + (PYTRITON if with_pytriton else ()):
        have = installed_version(name)
        print(f"{name}=={have}" if have else name)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.gpu_proof_wheels", description=__doc__)
    ap.add_argument("what", choices=("install", "fetch-list"))
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl")
    ap.add_argument("--with-pytriton", action="store_true", help="fetch-list: nvidia-pytriton too")
    ap.add_argument("--dry-run", action="store_true", help="install: say what, install nothing")
    a = ap.parse_args(argv)
    if a.what == "install":
        return install(a.wheels, a.dry_run)
    return fetch_list(a.with_pytriton)


if __name__ == "__main__":
    sys.exit(main())
