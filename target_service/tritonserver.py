"""The tritonserver installation: where its binary and Python backend are, and the environment
the server and its Python backend stubs run in.

- $FLASHMAP_TRITONSERVER, else the binary the nvidia-pytriton wheel ships (with a Python
  backend stub per Python version), else `tritonserver` on PATH (NVIDIA's image, with
  /opt/tritonserver/backends);
- LD_LIBRARY_PATH: this Python's LIBDIR first (the stub links libpython, and with a pyenv
  Python the system one would be picked otherwise), then the wheel's bundled libs; PYTHONPATH:
  the project and this interpreter's site-packages, so model.py imports target_service and
  torch from this environment.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class TritonStartError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready (message has the log tail)."""


@dataclass
class TritonDist:
    """Where a tritonserver installation keeps what we need."""

    binary: Path
    lib_dirs: list[Path] = field(default_factory=list)  # extra LD_LIBRARY_PATH entries
    python_backend: Path | None = None  # dir with libtriton_python.so (wheel layout)
    stub: Path | None = None  # triton_python_backend_stub for this Python (wheel layout)
    backend_dir: Path | None = None  # a ready backend directory (NVIDIA image layout)


def find_tritonserver() -> TritonDist:
    """Locate tritonserver: $FLASHMAP_TRITONSERVER, the nvidia-pytriton wheel, then PATH."""
    override = os.environ.get("FLASHMAP_TRITONSERVER")
    if override:
        binary = Path(override)
        if not binary.is_file():
            raise TritonStartError(f"FLASHMAP_TRITONSERVER={override}: no such file")
        return _system_dist(binary)
    try:
        import pytriton  # only for its file layout; its Python API is not used

        root = Path(pytriton.__file__).resolve().parent / "tritonserver"
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        dist = TritonDist(
            binary=root / "bin" / "tritonserver",
            lib_dirs=[root.parent.parent / "nvidia_pytriton.libs"],
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        )
        if not dist.stub.is_file():
            raise TritonStartError(
                f"nvidia-pytriton has no Python backend stub for Python {version} ({dist.stub}); "
                f"stubs exist for: {sorted(p.name for p in (root / 'python_backend_stubs').iterdir() if p.is_dir())}"
            )
        if dist.binary.is_file():
            return dist
    except ImportError:
        pass
    found = shutil.which("tritonserver")
    if found:
        return _system_dist(Path(found))
    raise TritonStartError(
        "no tritonserver binary: install the 'triton' extra (nvidia-pytriton), put tritonserver on PATH, "
        "or set FLASHMAP_TRITONSERVER"
    )


def _system_dist(binary: Path) -> TritonDist:
    # NVIDIA's image: /opt/tritonserver/bin/tritonserver with backends next to bin/.
    backends = binary.resolve().parent.parent / "backends"
    return TritonDist(binary=binary, backend_dir=backends if backends.is_dir() else None)


# ----------------------------------------------------------------------------- environment


def _python_libdir() -> str | None:
    return sysconfig.get_config_var("LIBDIR")


def server_env(dist: TritonDist, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and the Python backend stubs it spawns."""
    env = dict(os.environ if base is None else base)
    lib_dirs = [d for d in [_python_libdir(), *map(str, dist.lib_dirs)] if d]
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs)
    paths = sysconfig.get_paths()
    py_paths = [str(PROJECT_ROOT), paths["purelib"], paths["platlib"]]
    if env.get("PYTHONPATH"):
        py_paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = ":".join(dict.fromkeys(py_paths))  # dedupe, keep order
    # The stub (an embedded interpreter) must not pick up a different Python's home.
    env.pop("PYTHONHOME", None)
    # This Python's bin first, as pytriton does, so anything the backend spawns finds it.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env
