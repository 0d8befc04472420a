"""Start a local Triton Inference Server that hosts the FlashMap target model.

One module for one job, a tritonserver serving this model: the binary, its repository and
environment, the process and its health, the command line (options: TritonConfig).

    python -m target_service.launcher --model-dir CHECKPOINT [--grpc-port 8001 --http-port 8000
        --metrics-port 8002 --host 127.0.0.1 --n-slots 8 --max-seq-len N --idle-timeout-s 60]

Also a Python API for tests and `flashmap up`:

    handle = start_triton("/path/to/qwen3", grpc_port=..., log_path="triton.log")
    ...  # TargetClient(handle.grpc_url)
    handle.stop()

What it does:
- finds a tritonserver binary: $FLASHMAP_TRITONSERVER, else the one the nvidia-pytriton wheel
  ships, else `tritonserver` on PATH (NVIDIA's image, with /opt/tritonserver/backends);
- with the wheel, builds a backend directory in a scratch workspace holding the Python
  backend plus the stub built for the running Python (the wheel ships one per version);
- copies the model repository (target_service/model_repository) into the workspace and
  writes the settings Triton acts on (slots, idle timeout, queue delay, FEATURES type) into
  its config.pbtxt, so the sequence batcher and the model agree on them; model settings
  (checkpoint, max_seq_len, device, dtype) go to the model as FLASHMAP_TARGET_* variables;
- sets LD_LIBRARY_PATH (this Python's LIBDIR first: the stub links libpython, and with a
  pyenv Python the system one would be picked otherwise; then the wheel's bundled libs) and
  PYTHONPATH (the project and this interpreter's site-packages, so model.py imports
  target_service and torch from this environment);
- waits for /v2/health/ready, and on failure raises with the tail of the server log.

In NVIDIA's container the same repository is served directly (no launcher needed):
    PYTHONPATH=/app FLASHMAP_TARGET_DIR=/models/qwen3 tritonserver \
        --model-repository=/app/target_service/model_repository

One idea: the Triton configuration this project writes and the server process that reads it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path

from flashmap.auth import TARGET_KEY_ENV, TARGET_KEY_HEADER, read_secret
from flashmap.config import Config, at_least, option, parse
from flashmap.cpus import TARGET_CPUS_ENV, format_cpu_list, on_cpus

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"
MODEL_NAME = "flashmap_target"


class TritonStartError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready (message has the log tail)."""


# ----------------------------------------------------------------------------- binary


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


# ----------------------------------------------------------------------------- config


def write_model_repository(
    dest: Path,
    *,
    n_slots: int | None = None,
    idle_timeout_s: float | None = None,
    max_queue_delay_us: int | None = None,
    features_dtype: str | None = None,
    source: Path = MODEL_REPOSITORY,
) -> Path:
    """Copy the model repository to dest, writing the given Triton settings into config.pbtxt.

    These are the settings Triton itself acts on (the sequence batcher, the output type);
    model.py reads them back from its config. Settings left as None keep the checked-in
    values. Model-only settings (checkpoint, dtype, ...) travel as environment variables.
    """
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    cfg_path = dest / MODEL_NAME / "config.pbtxt"
    text = cfg_path.read_text()
    if n_slots is not None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        # One KV slot per sequence: Triton keeps at most n_slots sequences active (others wait
        # in its backlog) and a batch holds at most one request per sequence.
        text = _set_field(text, "max_batch_size", str(n_slots))
        text = _set_field(text, "max_candidate_sequences", str(n_slots))
    if idle_timeout_s is not None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        text = _set_field(text, "max_sequence_idle_microseconds", str(int(idle_timeout_s * 1e6)))
    if max_queue_delay_us is not None:
        text = _set_field(text, "max_queue_delay_microseconds", str(int(max_queue_delay_us)))
    if features_dtype is not None:
        # model.py sends FEATURES in whatever type this output declares.
        triton_type = {"float32": "TYPE_FP32", "float16": "TYPE_FP16"}[features_dtype]
        text, n = re.subn(
            r'(name: "FEATURES"\s*data_type: )TYPE_\w+', lambda m: m.group(1) + triton_type, text
        )
        if n != 1:
            raise ValueError(f"{cfg_path}: could not find the FEATURES output")
    cfg_path.write_text(text)
    return dest


def model_env(
    model_dir: str | Path | None = None,
    *,
    max_seq_len: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    feature_layers: list[int] | None = None,
    cuda_graphs: bool | None = None,
    cpus: set[int] | None = None,
    drafter_dir: str | Path | None = None,
    context_projection: str | None = None,
) -> dict[str, str]:
    """Model settings as the environment variables model.py reads (None: not set)."""
    env = {
        "FLASHMAP_TARGET_DIR": None if model_dir is None else str(Path(model_dir).resolve()),
        "FLASHMAP_TARGET_MAX_SEQ_LEN": None if max_seq_len is None else str(int(max_seq_len)),
        "FLASHMAP_TARGET_DEVICE": device,
        "FLASHMAP_TARGET_DTYPE": dtype,
        "FLASHMAP_TARGET_FEATURE_LAYERS": None
        if feature_layers is None
        else ",".join(map(str, feature_layers)),
        "FLASHMAP_TARGET_CUDA_GRAPHS": None
        if cuda_graphs is None
        else str(bool(cuda_graphs)).lower(),
        TARGET_CPUS_ENV: None if cpus is None else format_cpu_list(cpus),
        "FLASHMAP_DRAFTER_DIR": None if drafter_dir is None else str(Path(drafter_dir).resolve()),
        "FLASHMAP_CONTEXT_PROJECTION": context_projection,
    }
    return {k: v for k, v in env.items() if v is not None}


def _set_field(text: str, name: str, value: str) -> str:
    new, n = re.subn(rf"(\b{name}:\s*)[^\s\]]+", lambda m: m.group(1) + value, text)
    if n != 1:
        raise ValueError(f"config.pbtxt: expected exactly one '{name}' field, found {n}")
    return new


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


# ----------------------------------------------------------------------------- process


@dataclass
class TritonHandle:
    """A running tritonserver. stop() ends it (SIGTERM, then SIGKILL) and removes the workspace."""

    process: subprocess.Popen
    host: str
    grpc_port: int
    http_port: int
    metrics_port: int
    log_path: Path
    workspace: Path
    keep_workspace: bool = False

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def metrics(self) -> str:
        """The Prometheus text from /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server (graceful first); returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # tritonserver unloads models and exits
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if not self.keep_workspace:
            shutil.rmtree(self.workspace, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> TritonHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, n: int = 60) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


@dataclass
class TritonConfig(Config):
    """The launcher's options (flags: flashmap.config); start_triton takes the same names.
    Model settings left as None keep config.pbtxt's values (8 slots, a 60 s idle timeout) or
    the model's own choice (device and dtype by the hardware, the engine's feature layers)."""

    model_dir: str | None = option(help="Hugging Face Qwen3 checkpoint directory")
    host: str = option("127.0.0.1", "listen address of Triton's three endpoints")
    grpc_port: int = option(8001, "Triton gRPC", check=at_least(0))
    http_port: int = option(8000, "Triton HTTP", check=at_least(0))
    metrics_port: int = option(8002, "Triton /metrics", check=at_least(0))
    n_slots: int | None = option(None, "KV slots = concurrent sequences", check=at_least(1))
    max_seq_len: int | None = option(None, "context length of a slot", check=at_least(2))
    idle_timeout_s: float | None = option(
        None, "free a sequence's slot after this idle time", check=at_least(0.001)
    )
    max_queue_delay_us: int | None = option(
        None, "how long Triton waits to fill a batch", check=at_least(0)
    )
    device: str | None = option(None, "cpu, cuda, cuda:N (default: cuda if available)")
    dtype: str | None = option(
        None, "float32, bfloat16, float16 (default: bf16 on cuda, fp32 on cpu)"
    )
    feature_layers: str | None = option(
        None, "comma-separated decoder layers the drafter reads", check=_layer_list
    )
    features_dtype: str | None = option(
        None, "the features' type on the wire", choices=("float32", "float16")
    )
    drafter_dir: str | None = option(
        None,
        "the drafter checkpoint the features are for: its layers, and its context projection "
        "(flashmap.drafter_inputs)",
        env="FLASHMAP_DRAFTER_DIR",
    )
    context_projection: str | None = option(
        None,
        "apply the drafter's context projection here, so D values per token cross instead of "
        "layers x hidden (auto: with drafter_dir)",
        choices=("auto", "true", "false"),
        env="FLASHMAP_CONTEXT_PROJECTION",
    )
    log_path: str | None = option(
        None,
        "server log ('-': this process' output; default for the CLI: "
        "$TMPDIR/flashmap-triton-<grpc port>.log, for start_triton: in the workspace)",
    )
    log_verbose: int = option(0, "tritonserver --log-verbose", check=at_least(0))
    ready_timeout_s: float = option(600.0, "give up when not ready after this long")
    watchdog_s: float = option(
        10.0,
        "the CLI probes the model this often and exits when 3 probes in a row fail, so a "
        "supervisor (compose, k8s, flashmap up) restarts the server (0: off)",
        check=at_least(0),
    )


def start_triton(
    model_dir: str | Path | None,
    *,
    key: str = "",
    cpus: tuple[set[int], set[int]] | None = None,
    extra_env: dict[str, str] | None = None,
    keep_workspace: bool = False,
    **settings,
) -> TritonHandle:
    """Start tritonserver with the FlashMap target model and wait until it is ready.

    model_dir: Qwen3 checkpoint directory (None: the model reads $FLASHMAP_TARGET_DIR or
    its config parameter); settings: TritonConfig's fields (its defaults for the rest).
    log_path None: inside the workspace, which stop() removes. key: Triton's restricted
    protocols (inference, shared memory, model control, statistics, trace, logging; not health
    or metadata) then need the header flashmap.auth.TARGET_KEY_HEADER with this value. Raises
    TritonStartError (with the log tail) when it does not become ready. cpus: (the model
    worker's CPUs, the server's): the server and its stub run on the second set, the model's
    compute thread on the first (flashmap.cpus); None: wherever the caller runs.
    """
    c = TritonConfig(model_dir=None if model_dir is None else str(model_dir), **settings)
    host, grpc_port, http_port, metrics_port = c.host, c.grpc_port, c.http_port, c.metrics_port
    log_path = c.log_path
    dist = find_tritonserver()
    workspace = Path(tempfile.mkdtemp(prefix="flashmap-triton-"))
    try:
        repo = write_model_repository(
            workspace / "models",
            n_slots=c.n_slots,
            idle_timeout_s=c.idle_timeout_s,
            max_queue_delay_us=c.max_queue_delay_us,
            features_dtype=c.features_dtype,
        )
        backend_dir = dist.backend_dir
        if dist.stub is not None:
            # The Python backend looks for its stub next to libtriton_python.so.
            backend_dir = workspace / "backends"
            py = backend_dir / "python"
            py.mkdir(parents=True)
            for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
                (py / f).symlink_to(dist.python_backend / f)
            (py / "triton_python_backend_stub").symlink_to(dist.stub)
        to_stdout = (
            str(log_path) == "-"
        )  # in a container: the server's output is the container's log
        log_path = Path(log_path) if log_path else workspace / "tritonserver.log"
        if not to_stdout:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(dist.binary),
            f"--model-repository={repo}",
            f"--http-address={host}",
            f"--http-port={http_port}",
            f"--grpc-address={host}",
            f"--grpc-port={grpc_port}",
            f"--metrics-address={host}",
            f"--metrics-port={metrics_port}",
            "--allow-metrics=true",
            "--exit-on-error=true",
            # config.pbtxt is complete; auto-complete would start one more stub (and import torch).
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            "--exit-timeout-secs=15",
            f"--log-verbose={c.log_verbose}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        cmd += restricted_flags(key)
        env = server_env(dist)
        env.update(
            model_env(
                c.model_dir,
                max_seq_len=c.max_seq_len,
                device=c.device,
                dtype=c.dtype,
                feature_layers=_layer_list(c.feature_layers) if c.feature_layers else None,
                cpus=None if cpus is None else cpus[0],
                drafter_dir=c.drafter_dir,
                context_projection=c.context_projection,
            )
        )
        env.update(extra_env or {})
        log_file = None if to_stdout else open(log_path, "ab")
        try:
            with on_cpus(
                None if cpus is None else cpus[1]
            ):  # a child starts on its parent thread's CPUs
                process = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=workspace,  # not the caller's cwd: the stub puts its cwd on sys.path
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it cleanly
                )
        finally:
            if log_file is not None:
                log_file.close()
    except BaseException:
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    handle = TritonHandle(
        process, host, grpc_port, http_port, metrics_port, log_path, workspace, keep_workspace
    )
    try:
        wait_ready(handle, c.ready_timeout_s)
    except BaseException:
        handle.stop(timeout=10)
        raise
    return handle


RESTRICTED = "inference,shared-memory,model-config,model-repository,statistics,trace,logging"


def restricted_flags(key: str) -> list[str]:
    """tritonserver flags that put everything but health and metadata behind the target key."""
    if not key:
        return []
    return [
        f"--grpc-restricted-protocol={RESTRICTED}:{TARGET_KEY_HEADER}={key}",
        f"--http-restricted-api={RESTRICTED}:{TARGET_KEY_HEADER}={key}",
    ]


def _load_errors(path: Path) -> str:
    """Model load failures from a tritonserver log, unescaped (the table rows get cut off)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    found = re.findall(r"failed to load '([^']+)' version \d+: (.*)\"$", text, flags=re.M)
    unescape = lambda s: s.replace("\\n", "\n").replace('\\"', '"').rstrip()  # noqa: E731
    return "\n".join(f"model {name}: {unescape(msg)}" for name, msg in found)


def _start_failure(handle: TritonHandle, what: str) -> TritonStartError:
    errors = _load_errors(handle.log_path)
    return TritonStartError(
        f"{what}; log {handle.log_path}\n"
        + (f"{errors}\n--- log tail ---\n" if errors else "")
        + handle.log_tail(25 if errors else 60)
    )


def probe(
    grpc_url: str, key: str = "", timeout_s: float = 5.0, model: str = MODEL_NAME
) -> tuple[bool, str]:
    """A real request through the model (an INFO round trip on Triton's gRPC stream): (ok,
    detail). Triton's own readiness says nothing about a dead Python-backend stub; this does."""
    import random

    from flashmap import target_wire
    from flashmap.auth import TARGET_KEY_GRPC_HEADER
    from flashmap.triton_stream import StreamBroken, StreamError, call_once, infer_request

    request = infer_request(
        model,
        target_wire.info_inputs(),
        ["INFO_JSON"],
        random.getrandbits(62) | 1 << 62,
        start=True,
        end=True,
    )
    try:
        call_once(grpc_url, request, ((TARGET_KEY_GRPC_HEADER, key),) if key else (), timeout_s)
        return True, "INFO answered"
    except (StreamError, StreamBroken) as e:
        return False, str(e)


def wait_ready(handle: TritonHandle, timeout_s: float) -> None:
    """Poll /v2/health/ready until it answers 200; raise TritonStartError otherwise."""
    url = f"{handle.http_url}/v2/health/ready"
    deadline = time.monotonic() + timeout_s
    while True:
        code = handle.process.poll()
        if code is not None:
            raise _start_failure(
                handle, f"tritonserver exited with code {code} before it was ready"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise _start_failure(handle, f"tritonserver not ready after {timeout_s:.0f}s")
        time.sleep(0.25)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    c = parse(TritonConfig, argv, __doc__.split("\n")[0], "python -m target_service.launcher")
    if not Path(c.model_dir, "config.json").is_file():
        print(
            f"error: {c.model_dir}: no config.json (not a Hugging Face checkpoint directory)",
            file=sys.stderr,
        )
        return 2
    log_path = Path(
        c.log_path or Path(tempfile.gettempdir()) / f"flashmap-triton-{c.grpc_port}.log"
    )
    if c.log_path != "-":
        log_path.unlink(missing_ok=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # SIGTERM behaves like Ctrl-C: stop the server, exit 0

    # Set both explicitly: a shell starting us in the background may have set SIGINT to ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    handle = None
    try:
        settings = {f.name: getattr(c, f.name) for f in fields(c) if f.name != "watchdog_s"}
        handle = start_triton(
            **{**settings, "log_path": str(log_path)}, key=read_secret(TARGET_KEY_ENV)
        )
        print(
            f"triton ready: grpc {handle.grpc_url}  http {handle.http_url}  metrics {handle.metrics_url}  "
            f"log {handle.log_path}",
            flush=True,
        )
        failed, next_probe = 0, time.monotonic() + c.watchdog_s
        while handle.alive():
            time.sleep(0.5)
            if c.watchdog_s > 0 and time.monotonic() >= next_probe:
                ok, detail = probe(handle.grpc_url, read_secret(TARGET_KEY_ENV))
                failed = 0 if ok else failed + 1
                next_probe = time.monotonic() + c.watchdog_s
                if failed >= 3:
                    print(
                        f"error: the model failed 3 probes in a row ({detail}); stopping tritonserver",
                        file=sys.stderr,
                        flush=True,
                    )
                    handle.stop()
                    return 1
        code = handle.stop()
        print(
            f"error: tritonserver exited with code {code}; log tail:\n{log_tail(log_path)}",
            file=sys.stderr,
        )
        return 1
    except TritonStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # start_triton stops a server that was not ready yet; a running one is stopped here.
        if handle is not None:
            signal.signal(
                signal.SIGINT, signal.SIG_IGN
            )  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            handle.stop()
        print("triton stopped", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
