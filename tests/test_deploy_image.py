"""deploy/Dockerfile, deploy/compose.yaml and deploy/nginx/compose.conf: the image lints clean
with hadolint at error level and keeps the promises operations.md makes (pinned CUDA torch,
`.[cuda]`, non-root, caches on a volume, offline), the compose file is well formed and agrees
with the server's flags, and its nginx proxies exactly as the tested nginx config does.

No Docker engine runs here: the image is not built; Compose v2+ (docker's plugin or the standalone
`docker-compose`) validates the compose file, which needs no engine."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement

from clef_frontend.cli import build_parser, config_from
from tests.ci_policy import require, require_compose
from tests.conftest import REPO
from tests.deploy_tools import BASE, one

DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
NGINX_SHIPPED = DEPLOY / "nginx" / "clef-serve.conf"
NGINX_COMPOSE = DEPLOY / "nginx" / "compose.conf"
CACHE = "/var/cache/clef-serve"
# Keys a compose service may use here (a subset of the Compose specification's).
SERVICE_KEYS = {
    "image", "build", "init", "user", "read_only", "tmpfs", "cap_drop", "cap_add",
    "security_opt", "environment", "command", "entrypoint", "volumes", "expose", "ports",
    "stop_grace_period", "stop_signal", "restart", "ulimits", "deploy", "depends_on",
    "healthcheck", "networks", "labels", "logging",
}


# -- the Dockerfile ---------------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, rest = whole.partition(" ")
        found.append((keyword.upper(), rest.strip()))
    return found


def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def final_stage() -> list[tuple[str, str]]:
    steps = dockerfile()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def image_env(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in steps:
        if keyword == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def test_hadolint_passes_at_error_level() -> None:
    hadolint = require("hadolint")
    result = subprocess.run([hadolint, "--failure-threshold", "error", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_an_error(tmp_path: Path) -> None:
    """The lint really lints: a relative WORKDIR (DL3000, an error) fails it."""
    hadolint = require("hadolint")
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text().replace("WORKDIR /src", "WORKDIR src", 1))
    result = subprocess.run([hadolint, "--failure-threshold", "error", str(broken)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "DL3000" in result.stdout


def test_torch_is_the_pinned_cuda_build_in_the_projects_range() -> None:
    steps = dockerfile()
    args = dict(rest.partition("=")[::2] for keyword, rest in steps if keyword == "ARG")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX"])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    assert torch.specifier.contains(args["TORCH_VERSION"]), "outside pyproject's torch range"
    runs = " ".join(rest for keyword, rest in steps if keyword == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and '--index-url "${TORCH_INDEX}"' in runs
    # The project with its CUDA extra, torch held by the constraint.
    install = re.search(r'pip install --constraint (\S+) "\.\[([a-z,]+)\]"', runs)
    assert install, "pip install .[cuda] with the torch constraint"
    assert "cuda" in install[2].split(",")
    assert f"> {install[1]}" in runs, "the constraint file is the one written after torch"


def test_the_image_runs_unprivileged_offline_with_caches_on_the_volume() -> None:
    steps = final_stage()
    env = image_env(steps)
    assert env["HF_HUB_OFFLINE"] == "1"
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users, "the image must not run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    # The same ids as the pod (deploy/k8s), so the volume's files belong to both.
    documents = [yaml.safe_load(p.read_text()) for p in BASE.glob("deployment.yaml")]
    pod = one(documents, "Deployment")["spec"]["template"]["spec"]
    assert (int(uid), int(gid)) == (pod["securityContext"]["runAsUser"],
                                    pod["securityContext"]["runAsGroup"])
    volumes = [path for keyword, rest in steps if keyword == "VOLUME"
               for path in yaml.safe_load(rest)]
    assert volumes == [CACHE]
    for variable in ("TRITON_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "HF_HOME", "TRITON_HOME"):
        assert env[variable] == CACHE or env[variable].startswith(CACHE + "/"), variable
    # The pod points the kernel caches where the image does.
    pod_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    for variable in ("TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert pod_env[variable] == env[variable]
    assert env["PYTHONDONTWRITEBYTECODE"] == "1", "no bytecode writes on a read-only root"


def test_the_default_command_is_a_valid_server_command() -> None:
    steps = final_stage()
    entrypoint = yaml.safe_load(next(r for k, r in steps if k == "ENTRYPOINT"))
    command = yaml.safe_load(next(r for k, r in steps if k == "CMD"))
    assert entrypoint == ["clef-serve"]
    config = config_from(build_parser().parse_args(command))
    exposed = {int(port) for k, r in steps if k == "EXPOSE" for port in r.split()}
    assert exposed == {config.port, config.metrics_port}
    health = next(r for k, r in steps if k == "HEALTHCHECK")
    assert f"127.0.0.1:{config.port}/health" in health
    # Longer than the front's own start-up bound: a slow warm-up is not "unhealthy".
    start_period = re.search(r"--start-period=(\d+)s", health)
    assert start_period and int(start_period[1]) >= config.workers.startup_timeout


def test_the_build_context_holds_what_the_image_copies() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore, "send only what the image needs"
    for keyword, rest in dockerfile():
        if keyword == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignore}
                assert (REPO / source).exists()


# -- the compose file -------------------------------------------------------------------------

def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def mount(volume: str) -> tuple[str, str, str]:
    """(source, target, mode) of a short-syntax volume; the source may hold `${VAR:-default}`."""
    rest, mode = volume, "rw"
    if volume.endswith((":ro", ":rw")):
        rest, mode = volume[:-3], volume[-2:]
    source, _, target = rest.rpartition(":")
    return source, target, mode


def replicas(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in spec["services"].items()
            if service.get("image", "").startswith("clef-serve:")}


def test_compose_is_well_formed() -> None:
    spec = compose()
    assert set(spec) <= {"services", "volumes", "networks", "secrets", "configs", "name"} | {
        key for key in spec if key.startswith("x-")}
    named_volumes = set(spec.get("volumes", {}))
    for name, service in spec["services"].items():
        unknown = set(service) - SERVICE_KEYS
        assert not unknown, f"{name}: unknown keys {unknown}"
        for volume in service.get("volumes", []):
            source = mount(volume)[0]
            if not source.startswith((".", "/", "$")):
                assert source in named_volumes, f"{name}: volume {source} is not declared"
            elif source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name}: {source} is not shipped"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in spec["services"]
            assert condition["condition"] in {"service_started", "service_healthy"}


def test_compose_replicas_match_the_server_and_the_image() -> None:
    spec = compose()
    running = replicas(spec)
    assert len(running) == 2
    gpus = []
    for name, service in running.items():
        args, unknown = build_parser().parse_known_args(service["command"])
        assert not unknown, f"{name}: unknown flags {unknown}"
        config = config_from(args)
        assert service["read_only"] is True and service["user"] == "10001:10001"
        mounts = {mount(volume)[1]: mount(volume) for volume in service["volumes"]}
        model = config.workers.worker_argv[config.workers.worker_argv.index("--model") + 1]
        assert mounts[str(Path(model))][2] == "ro", "the model is mounted read-only"
        assert mounts[CACHE][0] in spec["volumes"], "the cache is a named volume"
        # The key file's directory is mounted (a single-file bind mount misses a rewrite).
        assert config.api_key_file is not None
        assert str(Path(config.api_key_file).parent) in mounts
        assert any(t.startswith("/tmp") for t in service["tmpfs"])
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert str(config.port) in service["expose"]
    assert len(gpus) == len(set(gpus)), "one GPU per replica"


def test_compose_nginx_proxies_to_every_replica() -> None:
    spec = compose()
    nginx = spec["services"]["nginx"]
    assert "./nginx/compose.conf:/etc/nginx/conf.d/default.conf:ro" in nginx["volumes"]
    servers = re.findall(r"^\s*server (\S+):(\d+) ", NGINX_COMPOSE.read_text(), re.MULTILINE)
    assert {(name, int(port)) for name, port in servers} == {
        (name, config_from(build_parser().parse_known_args(s["command"])[0]).port)
        for name, s in replicas(spec).items()}


def directives(text: str) -> list[str]:
    """The config's statements, comments and blank lines dropped, upstream servers left out."""
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not re.match(r"server \S+:\d+ ", line):
            found.append(" ".join(line.split()))
    return found


def test_compose_nginx_proxies_as_the_tested_config() -> None:
    """Same directives as deploy/nginx/clef-serve.conf (which test_nginx_failover.py runs in a
    real nginx), but for the upstream servers."""
    assert directives(NGINX_COMPOSE.read_text()) == directives(NGINX_SHIPPED.read_text())


def test_compose_nginx_config_is_accepted_by_nginx(tmp_path: Path) -> None:
    nginx = require("nginx")
    # The compose service names resolve only inside compose: loopback stands in for them.
    site = re.sub(r"server clef-serve-\d+:", "server 127.0.0.1:", NGINX_COMPOSE.read_text())
    (tmp_path / "site.conf").write_text(site.replace("listen 80;", "listen 127.0.0.1:1;"))
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\n"
        f"events {{}}\nhttp {{\n  access_log off;\n  include {tmp_path}/site.conf;\n}}\n")
    result = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_accepts_the_file() -> None:
    """Compose itself parses and validates the file (no engine needed for `config`)."""
    result = subprocess.run([*require_compose(), "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
