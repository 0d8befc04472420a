"""Start a local Triton Inference Server that hosts the FlashMap target model.

    python -m target_service.launcher --model-dir CHECKPOINT [--grpc-port 8001 --http-port 8000
        --metrics-port 8002 --host 127.0.0.1 --n-slots 8 --max-seq-len N --idle-timeout-s 60]

Also a Python API for tests and `flashmap up`:

    handle = start_triton("/path/to/qwen3", grpc_port=..., log_path="triton.log")
    ...  # TargetClient(handle.grpc_url)
    handle.stop()

What it does: finds tritonserver and builds the environment it runs in
(target_service.tritonserver); serves a copy of the model repository with this server's
settings in its config.pbtxt (target_service.triton_repository): Triton's (slots, idle
timeout, queue delay, FEATURES type) and the model's (TargetModelConfig:
target_service.target_config); puts Triton's restricted protocols behind the target key; waits
for /v2/health/ready, and on failure raises with the tail of the server log; and (the command)
probes the model and exits when it stops answering, for a supervisor to restart it.

In NVIDIA's container the same repository is served directly (no launcher needed), the model's
settings from the environment:
    PYTHONPATH=/app FLASHMAP_TARGET_DIR=/models/qwen3 tritonserver \
        --model-repository=/app/target_service/model_repository
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path

from flashmap.auth import TARGET_KEY_ENV, TARGET_KEY_HEADER
from flashmap.config import Config, at_least, option, parse, same_as, values_for
from flashmap.cpus import on_cpus
from target_service.target_config import TargetModelConfig, variable
from target_service.triton_repository import MODEL_NAME, write_model_repository
from target_service.tritonserver import TritonStartError, find_tritonserver, server_env

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


def _model_option(name: str):
    """The model's setting `name` (TargetModelConfig) as a flag of the launcher."""
    return same_as(TargetModelConfig, name, flag="")


@dataclass
class TritonConfig(Config):
    """The launcher's options (flags: flashmap.config); start_triton takes the same names. The
    server's own, then the model's (TargetModelConfig's: a flag here, its variable as the
    flag's default), which the model gets in the served config.pbtxt. Triton settings left as
    None keep config.pbtxt's values (8 slots, a 60 s idle timeout)."""

    host: str = option("127.0.0.1", "listen address of Triton's three endpoints")
    grpc_port: int = option(8001, "Triton gRPC", check=at_least(0))
    http_port: int = option(8000, "Triton HTTP", check=at_least(0))
    metrics_port: int = option(8002, "Triton /metrics", check=at_least(0))
    n_slots: int | None = option(None, "KV slots = concurrent sequences", check=at_least(1))
    idle_timeout_s: float | None = option(
        None, "free a sequence's slot after this idle time", check=at_least(0.001)
    )
    max_queue_delay_us: int | None = option(
        None, "how long Triton waits to fill a batch", check=at_least(0)
    )
    features_dtype: str | None = option(
        None, "the features' type on the wire", choices=("float32", "float16")
    )
    key: str = option(
        "",
        "Triton's restricted protocols (inference, shared memory, model control, statistics, "
        "trace, logging; not health or metadata) need this value in the target key header",
        env=TARGET_KEY_ENV,
        secret=True,
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
    # The model's settings.
    model_dir: str | None = _model_option("model_dir")
    max_seq_len: int | None = _model_option("max_seq_len")
    device: str = _model_option("device")
    dtype: str = _model_option("dtype")
    feature_layers: str | None = _model_option("feature_layers")
    cuda_graphs: str = _model_option("cuda_graphs")
    cpus: str | None = _model_option("cpus")
    drafter_dir: str | None = _model_option("drafter_dir")
    context_projection: str = _model_option("context_projection")

    def model_config(self) -> TargetModelConfig:
        return TargetModelConfig(**values_for(self, TargetModelConfig))


def start_triton(
    model_dir: str | Path | None,
    *,
    server_cpus: set[int] | None = None,
    extra_env: dict[str, str] | None = None,
    keep_workspace: bool = False,
    **settings,
) -> TritonHandle:
    """Start tritonserver with the FlashMap target model and wait until it is ready.

    model_dir: Qwen3 checkpoint directory (None: the model's environment's); settings:
    TritonConfig's fields (its defaults for the rest; the model's settings left at their
    defaults are the model's environment's: the server's, with extra_env). log_path None:
    inside the workspace, which stop() removes. key: Triton's restricted protocols then need
    the header flashmap.auth.TARGET_KEY_HEADER with this value. server_cpus: the server and
    its stub run there (the `cpus` setting: the model's compute thread; flashmap.cpus); None:
    wherever the caller runs. Raises TritonStartError (with the log tail) when it does not
    become ready.
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
            model=c.model_config(),
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
        cmd += restricted_flags(c.key)
        env = server_env(dist)
        env.update(extra_env or {})
        log_file = None if to_stdout else open(log_path, "ab")
        try:
            with on_cpus(server_cpus):  # a child starts on its parent thread's CPUs
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
    if c.model_dir is None:
        print(f"error: give --model-dir (or {variable('model_dir')})", file=sys.stderr)
        return 2
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
        handle = start_triton(**{**settings, "log_path": str(log_path)})
        print(
            f"triton ready: grpc {handle.grpc_url}  http {handle.http_url}  metrics {handle.metrics_url}  "
            f"log {handle.log_path}",
            flush=True,
        )
        failed, next_probe = 0, time.monotonic() + c.watchdog_s
        while handle.alive():
            time.sleep(0.5)
            if c.watchdog_s > 0 and time.monotonic() >= next_probe:
                ok, detail = probe(handle.grpc_url, c.key)
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
