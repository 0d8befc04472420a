"""`flashmap up`: the local stack as plain processes (Triton target, drafter, orchestrator).

The same entry points the containers run (deploy/docker-compose.yml), started on
loopback, each with its log file; `Stack` is also what the integration tests use.
Ctrl-C stops all three.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from drafter_service.service_config import DrafterServiceConfig
from flashmap.auth import (
    API_KEY_ENV,
    DRAFTER_TOKEN_ENV,
    TARGET_KEY_ENV,
    new_secret,
)
from flashmap.config import (
    Config,
    at_least,
    from_env,
    option,
    same_as,
    to_argv,
    values_for,
)
from flashmap.cpus import format_cpu_list, on_cpus, split_cpus
from flashmap.drafter_inputs import checkpoint_dir
from flashmap.grpc_serving import free_ports, ports_in_use, wait_grpc_health
from orchestrator.config import OrchestratorConfig
from target_service.launcher import TritonConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO_ROOT / "checkpoints" / "demo-target"
DEMO_DRAFTER = REPO_ROOT / "checkpoints" / "demo-flashmap-eq"


@dataclass
class StackConfig(Config):
    """The local stack: where each part listens and the options `flashmap up` passes on. A
    part's own option is the part's (flashmap.config.same_as: its default, help, variable and
    check), so a default lives in the part's config alone; `orchestrator_config`,
    `drafter_config` and `triton_config` make each part's config from this one."""

    target_dir: str = option(
        help="target checkpoint dir (flashmap up: the demo target, else a tiny random one)",
        flag="--target",
        env="FLASHMAP_TARGET_DIR",
    )
    drafter: str = same_as(
        DrafterServiceConfig,
        "drafter",
        help="drafter checkpoint dir or 'init' (flashmap up: the demo drafter with the demo "
        "target, else init)",
    )
    steps: int = same_as(DrafterServiceConfig, "steps")
    host: str = "127.0.0.1"  # `flashmap up` serves loopback; a deployment uses deploy/
    port: int = same_as(OrchestratorConfig, "port")
    metrics_port: int = same_as(OrchestratorConfig, "metrics_port")
    http_port: int = same_as(OrchestratorConfig, "http_port")
    drafter_port: int = same_as(DrafterServiceConfig, "port")
    drafter_metrics_port: int = same_as(DrafterServiceConfig, "metrics_port")
    triton_http_port: int = same_as(TritonConfig, "http_port")
    triton_grpc_port: int = same_as(TritonConfig, "grpc_port")
    triton_metrics_port: int = same_as(TritonConfig, "metrics_port")
    n_slots: int = option(8, "target KV slots (concurrent sequences)", check=at_least(1))
    max_seq_len: int = option(1024, "the target's context length", check=at_least(2))
    max_queue: int = same_as(OrchestratorConfig, "max_queue")
    # Triton's sequence-batcher wait for a fuller batch (None: config.pbtxt)
    max_queue_delay_us: int | None = same_as(TritonConfig, "max_queue_delay_us")
    draft_timeout_s: float = same_as(OrchestratorConfig, "draft_timeout_s")
    drafter_idle_timeout_s: float = same_as(DrafterServiceConfig, "idle_timeout_s")
    tree_blocks: int = same_as(OrchestratorConfig, "tree_blocks")
    tree_sampling: str = same_as(OrchestratorConfig, "tree_sampling")
    sibling_depth: int = same_as(OrchestratorConfig, "sibling_depth")
    top_m: int = same_as(OrchestratorConfig, "top_m")
    speculation: str = same_as(OrchestratorConfig, "speculation")
    plain_tokens: int = same_as(OrchestratorConfig, "plain_tokens")
    pipeline: bool = same_as(OrchestratorConfig, "pipeline")
    burst_window_s: float = same_as(OrchestratorConfig, "burst_window_s")
    target_timeout_s: float = same_as(OrchestratorConfig, "target_timeout_s")
    resume_timeout_s: float = same_as(OrchestratorConfig, "resume_timeout_s")
    # Secrets between the parts (flashmap.auth): fresh random ones unless given.
    target_key: str = field(default_factory=new_secret)
    drafter_token: str = field(default_factory=new_secret)
    api_key: str = same_as(OrchestratorConfig, "api_key")  # the public API's; "" = none
    log_dir: str | None = option(None, "the parts' logs (default: a new temporary directory)")
    with_drafter: bool = True
    # The target model's compute thread on cores of its own, every other process on the rest
    # (flashmap.cpus); off, or fewer than 2 usable CPUs: the scheduler places everything.
    pin_cpus: bool = option(True, "the target model's compute thread on cores of its own")
    context_projection: str | None = same_as(TritonConfig, "context_projection")

    def __post_init__(self) -> None:
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="flashmap-logs-")
        super().__post_init__()

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

    # The parts' configs: their options given here (values_for), where they find the others, and
    # the rest as the part would read them from the environment (from_env), so that to_argv
    # passes every option explicitly.
    def orchestrator_config(self) -> OrchestratorConfig:
        return from_env(
            OrchestratorConfig,
            **values_for(self, OrchestratorConfig),
            host=self.host,
            target_url=f"{self.host}:{self.triton_grpc_port}",
            drafter_url=self.drafter_url if self.with_drafter else "",
            tokenizer_dir=self.target_dir,
            target_key=self.target_key,
            drafter_token=self.drafter_token,
        )

    def drafter_config(self) -> DrafterServiceConfig:
        return from_env(
            DrafterServiceConfig,
            **values_for(self, DrafterServiceConfig),
            target_dir=self.target_dir,
            host=self.host,
            n_slots=self.drafter_slots,
            max_context=self.max_seq_len,
            token=self.drafter_token,
        )

    def triton_config(self) -> TritonConfig:
        return TritonConfig(
            **values_for(self, TritonConfig),
            model_dir=self.target_dir,
            host=self.host,
            n_slots=self.n_slots,
            max_seq_len=self.max_seq_len,
            key=self.target_key,
            # The target makes what the served drafter checkpoint reads (its layers, its
            # projection); a drafter made in the drafter's process ("init", the test oracle)
            # reads the default layers, unprojected.
            drafter_dir=checkpoint_dir(self.drafter) if self.with_drafter else None,
        )


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

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        """`python -m` args, with the secrets in its environment (flags would show them)."""
        c = self.cfg
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            DRAFTER_TOKEN_ENV: c.drafter_token,
            TARGET_KEY_ENV: c.target_key,
            API_KEY_ENV: c.api_key,
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

        t = self.cfg.triton_config()
        if self.cpus is not None:  # the model's compute thread on the first set
            t = replace(t, cpus=format_cpu_list(self.cpus[0]))
        self.triton = start_triton(
            **{**vars(t), "log_path": str(self._log("triton"))},
            server_cpus=None if self.cpus is None else self.cpus[1],
        )

    def start_drafter(self, wait: bool = True) -> None:
        cpus = {} if self.cpus is None else {"cpus": format_cpu_list(self.cpus[0] | self.cpus[1])}
        d = replace(self.cfg.drafter_config(), **cpus)
        self.drafter_proc = self._spawn("drafter", ["drafter_service.server", *to_argv(d)])
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
        proc = self._spawn(name, ["orchestrator.server", *to_argv(c.orchestrator_config())])
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
    torch processes on a small CPU box would each default to one thread per core and fight over
    the cores (docs/experiments/2026-12-02-threads-per-service.md)."""
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
