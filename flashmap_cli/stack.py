"""`flashmap up`: the local stack as plain processes (Triton target, drafter, orchestrator).

The same entry points the containers run (deploy/docker-compose.yml), started on
loopback, each with its log file; `Stack` is also what the integration tests use.
Ctrl-C stops all three.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashmap.auth import (
    API_KEY_ENV,
    DRAFTER_TOKEN_ENV,
    DRAFTER_TOKEN_LOCAL,
    TARGET_KEY_ENV,
    new_secret,
    read_secret,
    write_local_secret,
)
from flashmap.cpus import DRAFTER_CPUS_ENV, format_cpu_list, on_cpus, split_cpus
from flashmap.grpc_serving import free_ports, ports_in_use, wait_grpc_health
from flashmap.types import DECODE_STEPS
from orchestrator.admission import BurstConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO_ROOT / "checkpoints" / "demo-target"
DEMO_DRAFTER = REPO_ROOT / "checkpoints" / "demo-flashmap"


@dataclass
class StackConfig:
    target_dir: str
    drafter: str = "init"  # checkpoint dir or "init"
    steps: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400
    http_port: int = 8080  # the OpenAI-compatible API; 0 = off
    drafter_port: int = 50052
    drafter_metrics_port: int = 9401
    triton_http_port: int = 8000
    triton_grpc_port: int = 8001
    triton_metrics_port: int = 8002
    n_slots: int = 8
    max_seq_len: int = 1024
    max_queue: int = 256
    max_queue_delay_us: int | None = (
        None  # Triton's sequence-batcher wait for a fuller batch (None: config.pbtxt)
    )
    draft_timeout_s: float = 2.0
    drafter_idle_timeout_s: float = 300.0
    tree_blocks: int = 1  # > 1: greedy requests verify that many blocks as a tree
    speculation: str = (
        "auto"  # auto: draft lengths from measured costs; full: the whole block every round
    )
    decode_steps: int = DECODE_STEPS  # tokens per request of a round without drafts (the orchestrator's --decode-steps)
    pipeline: bool = (
        True  # the orchestrator's --pipeline: the next round without drafts queued while one runs
    )
    burst_window_ms: float = (
        BurstConfig.window_s * 1e3
    )  # the orchestrator's --burst-window-ms: requests sent together start in one round
    # Secrets between the parts (flashmap.auth): fresh random ones unless given.
    target_key: str = field(default_factory=new_secret)
    drafter_token: str = field(default_factory=new_secret)
    api_key: str = ""  # the public API's key; "" = none (loopback)
    target_timeout_s: float = 30.0  # the orchestrator's deadline for every call to Triton
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="flashmap-logs-"))
    with_drafter: bool = True
    # The target model's compute thread on cores of its own, every other process on the rest
    # (flashmap.cpus); off, or fewer than 2 usable CPUs: the scheduler places everything.
    pin_cpus: bool = True

    PORTS = (
        "port",
        "metrics_port",
        "http_port",
        "drafter_port",
        "drafter_metrics_port",
        "triton_http_port",
        "triton_grpc_port",
        "triton_metrics_port",
    )
    DRAFTER_PORTS = ("drafter_port", "drafter_metrics_port")  # unused by a stack without a drafter

    @classmethod
    def on_free_ports(cls, **kw) -> StackConfig:
        return cls(**{**dict(zip(cls.PORTS, free_ports(len(cls.PORTS)))), **kw})

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (what an OpenAI client takes as base_url)."""
        return f"http://{self.host}:{self.http_port}/v1"

    @property
    def drafter_url(self) -> str:
        return f"{self.host}:{self.drafter_port}"

    @property
    def drafter_slots(self) -> int:
        """The drafter's context slots: room beyond the target's for sequences it still holds."""
        return max(64, 2 * self.n_slots)


class PortsInUse(RuntimeError):
    """A port of the stack is held by another process."""


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.triton = None
        self.drafter_proc: subprocess.Popen | None = None
        self.orch_proc: subprocess.Popen | None = None
        self.extra_procs: list[subprocess.Popen] = []  # extra_orchestrator's
        self.cpus: tuple[set[int], set[int]] | None = (
            None  # (the target worker's, everyone else's); start() sets
        )
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)

    def _log(self, name: str) -> Path:
        return Path(self.cfg.log_dir) / f"{name}.log"

    def _spawn(self, name: str, args: list[str], **extra_env: str) -> subprocess.Popen:
        c = self.cfg
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            DRAFTER_TOKEN_ENV: c.drafter_token,
            TARGET_KEY_ENV: c.target_key,
            API_KEY_ENV: c.api_key,
            **extra_env,
        }
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        f = open(self._log(name), "ab")
        with on_cpus(
            None if self.cpus is None else self.cpus[1]
        ):  # a child starts on its parent thread's CPUs
            return subprocess.Popen(
                [sys.executable, "-m", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )

    def start_target(self) -> None:
        from target_service.launcher import start_triton

        c = self.cfg
        self.triton = start_triton(
            c.target_dir,
            host=c.host,
            http_port=c.triton_http_port,
            grpc_port=c.triton_grpc_port,
            metrics_port=c.triton_metrics_port,
            n_slots=c.n_slots,
            max_seq_len=c.max_seq_len,
            max_queue_delay_us=c.max_queue_delay_us,
            log_path=str(self._log("triton")),
            key=c.target_key,
            cpus=self.cpus,
        )

    def start_drafter(self, wait: bool = True) -> None:
        c = self.cfg
        self.drafter_proc = self._spawn(
            "drafter",
            [
                "drafter_service.server",
                "--target-dir",
                c.target_dir,
                "--drafter",
                c.drafter,
                "--host",
                c.host,
                "--port",
                str(c.drafter_port),
                "--metrics-port",
                str(c.drafter_metrics_port),
                "--steps",
                str(c.steps),
                "--n-slots",
                str(c.drafter_slots),
                "--max-context",
                str(c.max_seq_len),
                "--idle-timeout-s",
                str(c.drafter_idle_timeout_s),
            ],
            **(
                {}
                if self.cpus is None
                else {DRAFTER_CPUS_ENV: format_cpu_list(self.cpus[0] | self.cpus[1])}
            ),
        )
        if wait:
            self.wait_drafter()

    def wait_drafter(self) -> None:
        wait_grpc_health(self.cfg.drafter_url, 180, self.drafter_proc, self._log("drafter"))

    def stop_drafter(self) -> None:
        stop_process(self.drafter_proc)
        self.drafter_proc = None

    def start_orchestrator(self) -> None:
        self.orch_proc = self._orchestrator(self.cfg, "orchestrator")

    def _orchestrator(self, c: StackConfig, name: str) -> subprocess.Popen:
        proc = self._spawn(
            name,
            [
                "orchestrator.server",
                "--host",
                c.host,
                "--port",
                str(c.port),
                "--metrics-port",
                str(c.metrics_port),
                "--http-port",
                str(c.http_port),
                "--target-url",
                f"{c.host}:{c.triton_grpc_port}",
                "--drafter-url",
                c.drafter_url if c.with_drafter else "",
                "--tokenizer-dir",
                c.target_dir,
                "--max-queue",
                str(c.max_queue),
                "--draft-timeout-s",
                str(c.draft_timeout_s),
                "--tree-blocks",
                str(c.tree_blocks),
                "--speculation",
                c.speculation,
                "--decode-steps",
                str(c.decode_steps),
                "--pipeline" if c.pipeline else "--no-pipeline",
                "--burst-window-ms",
                str(c.burst_window_ms),
                "--target-timeout-s",
                str(c.target_timeout_s),
            ],
        )
        wait_grpc_health(c.url, 300, proc, self._log(name))
        return proc

    def extra_orchestrator(self, name: str, **changes) -> tuple[subprocess.Popen, StackConfig]:
        """A second orchestrator over the same Triton and drafter, on free ports, with these
        StackConfig fields changed (e.g. speculation="full"): benchmarks compare the two
        without restarting either. It stops with the stack (or before, by `stop_process`)."""
        port, metrics_port = free_ports(2)
        cfg = replace(self.cfg, port=port, metrics_port=metrics_port, http_port=0, **changes)
        proc = self._orchestrator(cfg, name)
        self.extra_procs.append(proc)
        return proc, cfg

    def restart_orchestrator(self, **changes) -> None:
        """Stop the orchestrator and start it again with these StackConfig fields changed."""
        stop_process(self.orch_proc)
        self.cfg = replace(self.cfg, **changes)
        self.start_orchestrator()

    def start(self) -> Stack:
        """Start the three services. PortsInUse, with nothing started, when one of the ports is
        held already: the health checks would find the other server's parts and call this stack up."""
        c = self.cfg
        names = [n for n in c.PORTS if c.with_drafter or n not in c.DRAFTER_PORTS]
        wanted = {getattr(c, n): n for n in names if getattr(c, n)}  # 0: that server is off
        busy = ports_in_use(c.host, list(wanted))
        if busy:
            raise PortsInUse(
                ", ".join(f"{c.host}:{p} ({wanted[p]})" for p in busy)
                + " in use: another stack or "
                "server holds them; stop it or choose other ports (flashmap up --help)"
            )
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_service()))  # children inherit it
        if self.cfg.pin_cpus:
            self.cpus = split_cpus(_int_or(os.environ["OMP_NUM_THREADS"], threads_per_service()))
        try:
            if self.cfg.with_drafter:
                self.start_drafter(wait=False)  # loads while Triton starts
            self.start_target()
            if self.cfg.with_drafter:
                self.wait_drafter()
            self.start_orchestrator()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.extra_procs:
            stop_process(proc)
        self.extra_procs = []
        stop_process(self.orch_proc)
        self.stop_drafter()
        if self.triton is not None:
            self.triton.stop()
            self.triton = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Supervisor:
    """Keeps the three parts of a Stack alive: a part that exits, or a Triton whose model fails
    `probe_failures` probes in a row (its Python stub died: Triton itself still says ready),
    is restarted with exponential back-off; each death is logged once."""

    def __init__(
        self,
        stack: Stack,
        probe_interval_s: float = 3.0,
        probe_failures: int = 3,
        max_backoff_s: float = 30.0,
        log=print,
    ):
        self.stack, self.log = stack, log
        self.probe_interval_s, self.probe_failures, self.max_backoff_s = (
            probe_interval_s,
            probe_failures,
            max_backoff_s,
        )
        self.restarts = {"triton": 0, "drafter": 0, "orchestrator": 0}
        self._down: dict[str, float] = {}  # part -> time.monotonic() it may be restarted
        self._backoff = {k: 1.0 for k in self.restarts}
        self._failed_probes = 0
        self._next_probe = 0.0

    def _dead(self) -> dict[str, str]:
        """Parts that need a restart -> why."""
        from target_service.launcher import probe

        st, out = self.stack, {}
        if st.triton is not None:
            if not st.triton.alive():
                out["triton"] = f"tritonserver exited with code {st.triton.process.returncode}"
            elif time.monotonic() >= self._next_probe:
                self._next_probe = time.monotonic() + self.probe_interval_s
                ok, detail = probe(st.triton.grpc_url, st.cfg.target_key)
                self._failed_probes = 0 if ok else self._failed_probes + 1
                if self._failed_probes >= self.probe_failures:
                    out["triton"] = (
                        f"the model failed {self._failed_probes} probes in a row ({detail})"
                    )
        for name, proc in (("drafter", st.drafter_proc), ("orchestrator", st.orch_proc)):
            if proc is not None and proc.poll() is not None:
                out[name] = f"exited with code {proc.returncode}"
        return out

    def step(self) -> None:
        """Check once; restart what is due."""
        now = time.monotonic()
        for name, why in self._dead().items():
            if name not in self._down:
                self._down[name] = now + self._backoff[name]
                self.log(
                    f"{name}: {why}; restarting in {self._backoff[name]:.0f} s (log {self.stack._log(name)})"
                )
            if now < self._down[name]:
                continue
            try:
                {
                    "triton": self._restart_triton,
                    "drafter": self.stack.start_drafter,
                    "orchestrator": self.stack.start_orchestrator,
                }[name]()
            except Exception as e:  # noqa: BLE001 - try again later, longer back-off
                self._backoff[name] = min(2 * self._backoff[name], self.max_backoff_s)
                self._down[name] = time.monotonic() + self._backoff[name]
                self.log(f"{name}: restart failed ({e}); next try in {self._backoff[name]:.0f} s")
                continue
            self.restarts[name] += 1
            self._backoff[name] = min(2 * self._backoff[name], self.max_backoff_s)
            del self._down[name]
            self.log(f"{name}: restarted")

    def _restart_triton(self) -> None:
        if self.stack.triton is not None:
            self.stack.triton.stop(timeout=10)
        self._failed_probes = 0
        self.stack.start_target()

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        while not stop.wait(interval_s):
            self.step()


def threads_per_service() -> int:
    """Torch threads each service gets unless OMP_NUM_THREADS says: half the cores. Three
    torch processes on a small CPU box each default to one thread per core and fight over the
    cores (verify rounds ran 10x slower); on 2 cores, 2 threads per service halve the stack's
    throughput while one process alone gains from them (bench.threads_per_service)."""
    return max(1, (os.cpu_count() or 2) // 2)


def _int_or(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:  # OMP_NUM_THREADS may be a nested list ("4,2")
        return default


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def default_checkpoints(target: str | None, drafter: str | None) -> tuple[str, str, list[str]]:
    """The demo checkpoints when they exist, else a tiny random target (said so)."""
    notes = []
    if target is None:
        if (DEMO_TARGET / "config.json").is_file():
            target = str(DEMO_TARGET)
        else:
            from target_service.random_checkpoint import make_random_qwen3

            target = str(make_random_qwen3(Path(tempfile.gettempdir()) / "flashmap-random-qwen3"))
            notes.append(
                f"no demo checkpoint: serving a tiny RANDOM Qwen3 at {target} (its text is noise)"
            )
    if drafter is None:
        drafter = (
            str(DEMO_DRAFTER)
            if (DEMO_DRAFTER / "config.json").is_file() and target == str(DEMO_TARGET)
            else "init"
        )
        if drafter == "init":
            notes.append(
                "no trained drafter for this target: using an untrained FlashMap drafter (exact, low acceptance)"
            )
    return target, drafter, notes


def add_stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=os.environ.get("FLASHMAP_TARGET_DIR"),
        help="target checkpoint dir (default: demo)",
    )
    p.add_argument(
        "--drafter",
        default=os.environ.get("FLASHMAP_DRAFTER_DIR"),
        help="drafter checkpoint dir or 'init'",
    )
    p.add_argument("--steps", type=int, default=int(os.environ.get("FLASHMAP_DRAFT_STEPS", "1")))
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9400)
    p.add_argument(
        "--http-port", type=int, default=8080, help="OpenAI-compatible HTTP API; 0 = off"
    )
    p.add_argument("--drafter-port", type=int, default=50052)
    p.add_argument("--drafter-metrics-port", type=int, default=9401)
    p.add_argument("--triton-ports", default="8000,8001,8002", help="HTTP,gRPC,metrics")
    p.add_argument("--n-slots", type=int, default=8, help="target KV slots (concurrent sequences)")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--log-dir", default=None)


def run_stack(args) -> int:
    target, drafter, notes = default_checkpoints(args.target, args.drafter)
    for n in notes:
        print(f"note: {n}", flush=True)
    http, grpc_port, metrics = (int(x) for x in args.triton_ports.split(","))
    cfg = StackConfig(
        target_dir=target,
        drafter=drafter,
        steps=args.steps,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        drafter_port=args.drafter_port,
        drafter_metrics_port=args.drafter_metrics_port,
        triton_http_port=http,
        triton_grpc_port=grpc_port,
        triton_metrics_port=metrics,
        n_slots=args.n_slots,
        max_seq_len=args.max_seq_len,
        api_key=read_secret(API_KEY_ENV),  # clients must send it when set
        **({"log_dir": args.log_dir} if args.log_dir else {}),
    )
    # SIGTERM (docker stop, kill, a supervisor) must stop the three children like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(
        f"starting Triton target, drafter and orchestrator (logs in {cfg.log_dir}) ...", flush=True
    )
    try:
        stack = Stack(cfg).start()
    except PortsInUse as e:
        print(f"flashmap up: {e}", file=sys.stderr, flush=True)
        return 1
    # For `flashmap steps` and DrafterAdmin in this user's other shells.
    write_local_secret(DRAFTER_TOKEN_LOCAL, cfg.drafter_token)
    lines = [
        "FlashMap Serve is up",
        f'  Generate (gRPC)      {cfg.url}        try: flashmap generate --chat "What can you do?" --url {cfg.url}',
        f"  OpenAI API (HTTP)    {cfg.http_url}  (/completions, /chat/completions, /models)"
        if cfg.http_port
        else "",
        f"  orchestrator metrics http://{cfg.host}:{cfg.metrics_port}/metrics",
        f"  drafter (gRPC)       {cfg.drafter_url}  metrics http://{cfg.host}:{cfg.drafter_metrics_port}/metrics",
        f"  Triton               grpc {cfg.host}:{cfg.triton_grpc_port}  metrics http://{cfg.host}:{cfg.triton_metrics_port}/metrics",
        f"  target {target}\n  drafter {drafter} (steps {cfg.steps})",
        "Ctrl-C stops all three.",
    ]
    print("\n".join(x for x in lines if x), flush=True)
    supervisor = Supervisor(stack, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        while True:
            supervisor.step()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
    finally:
        stack.stop()
    return 0
