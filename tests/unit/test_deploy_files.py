"""docker-compose and the Kubernetes manifests name real commands, queues and health checks."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from worker.cli import app
from worker.jobs.registry import queues
from worker.settings import Settings
from worker.settings_rules import variable_names

QUEUES = queues()

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_compose_has_every_service_the_design_names():
    expected = {"postgres", "redis", "migrate", "api", "beat", "flower"} | {f"worker-{q}" for q in QUEUES}
    assert expected <= set(SERVICES)


def test_stores_have_health_checks_and_services_wait_for_them():
    assert "pg_isready" in " ".join(SERVICES["postgres"]["healthcheck"]["test"])
    assert "ping" in SERVICES["redis"]["healthcheck"]["test"]
    for name in ("api", "worker-extraction", "beat"):
        depends = SERVICES[name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy"
        assert depends["migrate"]["condition"] == "service_completed_successfully"


def _commands() -> list[list[str]]:
    commands = [s["command"] for s in SERVICES.values() if isinstance(s.get("command"), list)]
    for manifest in ("factmill.yaml",):
        for doc in yaml.safe_load_all((REPO / "deploy" / "k8s" / manifest).read_text()):
            spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
            commands += [
                c["args"] for c in spec.get("containers", []) if c.get("image", "").startswith("factmill")
            ]
    return [c for c in commands if c and c[0] in {"serve", "worker", "beat", "flower", "db"}]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c[:3]))
def test_every_deployed_command_is_a_real_factmill_command(command):
    result = CliRunner().invoke(app, [*command[: 2 if command[0] == "db" else 1], "--help"])
    assert result.exit_code == 0, result.output
    if command[0] == "worker":
        queues = command[command.index("--queues") + 1].split(",")
        assert set(queues) <= set(QUEUES)
    # Every command's flags, not the worker's alone (a renamed `serve` or `db upgrade` option passed),
    # read from the command's declared options: its help text mentions flags in other options' words
    # ("With --pool prefork"), and with colour forced Rich splits a flag's name across colour codes.
    words = command[: 2 if command[0] == "db" else 1]
    declared = {
        name for param in _click_command(words).params for name in (*param.opts, *param.secondary_opts)
    }
    for flag in (token.split("=", 1)[0] for token in command if token.startswith("-")):
        assert flag in declared, f"{flag} is not an option of `factmill {' '.join(words)}`"


def _click_command(words: list[str]) -> Any:
    """The command ``factmill WORDS`` runs (Typer's own click: it vendors one), loading lazy groups."""
    command: Any = typer.main.get_command(app)
    for word in words:
        assert hasattr(command, "get_command"), f"`factmill {' '.join(words)}` has no subcommands"
        command = command.get_command(command.context_class(command), word)
        assert command is not None, f"`factmill {' '.join(words)}` is no command"
    return command


def test_the_flag_check_sees_an_option_a_command_does_not_have():
    for command in (
        ["serve", "--bogus", "1"],
        ["db", "upgrade", "--waiting"],
        ["flower", "--hosts", "x"],
        ["worker", "--queues", "extraction", "--procs", "1"],  # "--processes" is in the help all the same
    ):
        with pytest.raises(AssertionError, match="is not an option of"):
            test_every_deployed_command_is_a_real_factmill_command(command)


def _k8s_docs() -> list[dict]:
    docs: list[dict] = []
    for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _deployed_env_names() -> set[str]:
    names: set[str] = set()
    for service in SERVICES.values():
        env = service.get("environment") or {}
        names |= set(env if isinstance(env, dict) else (e.split("=", 1)[0] for e in env))
    for doc in _k8s_docs():
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "factmill":
            names |= set(doc["data"])
    names -= {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"}  # the postgres image's own
    return names


def test_every_setting_that_chooses_the_model_reaches_the_compose_services():
    """Compose passes only the variables it lists: FACTMILL_EMBEDDING_MODEL, exported as the README
    says, never reached the containers (an OpenAI-compatible deployment's vector search stayed off)."""
    choosing = {"FACTMILL_LLM", "FACTMILL_LLM_MODEL", "FACTMILL_LLM_BASE_URL", "FACTMILL_EMBEDDING_MODEL"}
    for name in ("api", "worker-extraction"):
        env = SERVICES[name].get("environment") or {}
        missing = (choosing | {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}) - set(env)
        assert not missing, f"{name} does not pass {sorted(missing)}"


def test_every_deployed_environment_variable_is_a_setting():
    unknown = _deployed_env_names() - variable_names(Settings.model_fields)
    assert not unknown, f"compose/k8s set variables Settings does not read: {sorted(unknown)}"


def _health_commands() -> dict[str, str]:
    """Service name -> its health check (compose) as one string."""
    return {name: " ".join(s["healthcheck"]["test"]) for name, s in SERVICES.items() if "healthcheck" in s}


def _worker_nodes(args: list[str]) -> set[str] | None:
    """The Celery node names `factmill <args>` (a worker command) runs as, or None when they depend on
    the host: with the threads pool and no --processes, one process per core, each named name-N@host."""
    from worker.cli.processes import child_hostname

    node = args[args.index("--hostname") + 1]
    pool = args[args.index("--pool") + 1] if "--pool" in args else "threads"
    if "--processes" not in args:
        return {node} if pool != "threads" else None
    count = int(args[args.index("--processes") + 1])
    return {node} if count == 1 else {child_hostname(node, n) for n in range(count)}


def test_the_node_names_of_a_worker_command():
    assert _worker_nodes(["worker", "--processes", "1", "--hostname", "x@%h"]) == {"x@%h"}
    assert _worker_nodes(["worker", "--processes", "2", "--hostname", "x@%h"]) == {"x-0@%h", "x-1@%h"}
    assert _worker_nodes(["worker", "--pool", "prefork", "--hostname", "x@%h"]) == {"x@%h"}
    assert _worker_nodes(["worker", "--hostname", "x@%h"]) is None


def test_every_service_has_a_health_check_that_fits_it():
    checks = _health_commands()
    assert set(checks) >= set(SERVICES) - {"migrate"}, "a long-running service has no health check"
    assert "/healthz" in checks["api"] and ":8000" in checks["api"]
    assert "/healthcheck" in checks["flower"] and ":5555" in checks["flower"]
    assert "celerybeat-schedule" in checks["beat"]
    for queue in QUEUES:
        service = SERVICES[f"worker-{queue}"]
        command = service["command"]
        node = command[command.index("--hostname") + 1]
        assert node == f"{queue}@%h"
        # The ping goes to the worker's own node: the name it was started with, %h being $HOSTNAME. With
        # a process per core (the default), the nodes were name-N@host and the ping found none.
        assert _worker_nodes(command) == {node}, f"worker-{queue} runs as other nodes than it pings"
        assert "celery -A worker.celery_app inspect ping" in checks[f"worker-{queue}"]
        assert f"--destination {node.replace('%h', '$$HOSTNAME')}" in checks[f"worker-{queue}"]


def test_the_beat_check_reads_the_file_beat_writes():
    from worker.cli import services

    source = Path(services.__file__).read_text()
    assert '"celerybeat-schedule"' in source  # beat -s <data_dir>/celerybeat-schedule
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert "FACTMILL_DATA_DIR=/app/var" in dockerfile
    assert "/app/var/celerybeat-schedule" in _health_commands()["beat"]


def test_the_image_declares_no_api_only_health_check():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert not [line for line in dockerfile.splitlines() if line.strip().startswith("HEALTHCHECK")]


def test_kubernetes_workers_beat_and_flower_have_liveness_probes():
    deployments = {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] == "Deployment"}
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert "livenessProbe" in container, name
        args = container["args"]
        if args[0] == "worker":
            node = args[args.index("--hostname") + 1]
            assert _worker_nodes(args) == {node}, f"{name} runs as other nodes than its probe pings"
            probe = " ".join(container["livenessProbe"]["exec"]["command"])
            assert f"--destination {node.replace('%h', '$HOSTNAME')}" in probe


def test_compose_postgres_ships_pgvector_and_migrations_enable_it():
    assert SERVICES["postgres"]["image"].startswith("pgvector/pgvector:")
    from worker.search.vector_ddl import VECTOR_STORE_DDL

    assert "CREATE EXTENSION IF NOT EXISTS vector" in VECTOR_STORE_DDL
    assert "VECTOR_STORE_DDL" in (REPO / "alembic" / "versions" / "0003_search.py").read_text()


def _dockerfile_copies() -> set[str]:
    """What the image's COPY lines take from the repository (sources, not destinations)."""
    copied: set[str] = set()
    for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            copied |= {w.rstrip("/") for w in words[1:-1]}
    return copied


def _imported_packages(folder: Path) -> set[str]:
    """The repository's own top-level packages that the Python files under ``folder`` import."""
    import ast

    own = {p.parent.name for p in REPO.glob("*/__init__.py")}
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found & own


def test_the_image_holds_every_package_its_code_imports():
    """The image left out factmill_client, which worker.core.signing and the demo import: `factmill
    serve` in it ended in ModuleNotFoundError."""
    copied = _dockerfile_copies()
    assert {"worker", "tasks", "models", "alembic", "alembic.ini"} <= copied
    for package in ("worker", "tasks", "models"):
        missing = _imported_packages(REPO / package) - copied
        assert not missing, f"{package}/ imports {sorted(missing)}, which deploy/Dockerfile does not copy"


def _compose_environment(exported: dict[str, str], service: str = "api") -> dict[str, str]:
    """The factmill services' environment as `docker compose` passes it with ``exported`` set in the
    shell: `${VAR:?message}` needs VAR, `${VAR:-default}` falls back to the default ("" too)."""
    import re

    def interpolate(value: str) -> str:
        def one(match: re.Match[str]) -> str:
            name, kind, rest = match.group(1), match.group(2), match.group(3)
            if kind == ":?":
                assert exported.get(name), f"compose needs {name}: {rest}"
            return exported.get(name) or (rest if kind == ":-" else "")

        return re.sub(r"\$\{(\w+)(:[?-])?([^}]*)\}", one, str(value))

    return {name: interpolate(value) for name, value in SERVICES[service]["environment"].items()}


@pytest.mark.parametrize(
    ("exported", "refusal"),
    [
        ({"OPENAI_API_KEY": "sk-test"}, None),
        ({"FACTMILL_LLM": "simulator"}, None),
        ({}, "no LLM API key: set OPENAI_API_KEY or ANTHROPIC_API_KEY (or FACTMILL_LLM=simulator"),
    ],
    ids=["a key", "the simulator named", "nothing"],
)
def test_compose_runs_with_what_its_header_says_to_export(monkeypatch, exported, refusal):
    """`docker compose up` as its header says (secrets and OPENAI_API_KEY, no FACTMILL_LLM) started no
    factmill container: `FACTMILL_LLM: ${FACTMILL_LLM:-}` arrived as "", refused as no provider."""
    from worker.settings import InsecureSecretsError, Settings

    secrets = {
        "FACTMILL_WEBHOOK_SECRET": "w" * 64,
        "FACTMILL_ADMIN_TOKEN": "a" * 64,
        "POSTGRES_PASSWORD": "p" * 32,
    }
    for name in list(os.environ):
        if name.startswith(("FACTMILL_", "FLOWER_")) or name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
            monkeypatch.delenv(name)
    for name, value in _compose_environment(secrets | exported).items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)
    if refusal is None:
        settings.check_production_secrets()
    else:
        with pytest.raises(InsecureSecretsError) as refused:
            settings.check_production_secrets()
        assert refusal in str(refused.value)


# Past FACTMILL_GRACE_SECONDS a stopping API or worker exits by itself; the supervisor must wait that long
# and a little more, or its SIGKILL cuts the graceful stop short (jobs then wait for the sweeper).
STOP_MARGIN = 10


def _seconds(value: str) -> float:
    assert value.endswith("s") and value[:-1].isdigit(), value  # compose durations here: "45s"
    return float(value[:-1])


def test_compose_waits_out_the_grace_period_of_every_api_and_worker():
    from worker.settings import Settings

    grace = Settings(_env_file=None).grace_seconds
    for name, service in SERVICES.items():
        if service.get("command", [None])[0] in ("serve", "worker"):
            waits = _seconds(service.get("stop_grace_period", "10s"))  # compose's default: 10 s
            assert waits >= grace + STOP_MARGIN, f"{name} is killed {waits:.0f} s into a {grace:.0f} s grace"


def test_kubernetes_waits_out_the_grace_period_of_every_api_and_worker():
    from worker.settings import Settings

    grace = Settings(_env_file=None).grace_seconds
    for doc in _k8s_docs():
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            (container,) = spec["containers"]
            if container["args"][0] in ("serve", "worker"):
                waits = spec.get("terminationGracePeriodSeconds", 30)  # the kubelet's default
                assert waits >= grace + STOP_MARGIN, f"{doc['metadata']['name']} is killed at {waits} s"


def test_the_image_build_sends_no_local_clutter_and_copies_nothing_ignored():
    """No .dockerignore sent .venv (770 MB) and the caches with every build; what the Dockerfile copies
    must not be ignored, and the README (edited often) comes after the dependency layer."""
    import fnmatch

    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git", ".mypy_cache"} <= set(ignored)
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    copied = [
        source
        for line in dockerfile.splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for source in line.split()[1:-1]
    ]
    assert copied and all((REPO / source).exists() for source in copied), copied
    assert not [s for s in copied for p in ignored if fnmatch.fnmatch(s, p.removeprefix("**/"))]
    dependencies = dockerfile.index("pip install '.[otel]'")
    assert dockerfile.index("README.md ./") > dependencies  # the real README only after the deps


def test_the_image_leaves_the_code_read_only_to_its_service_user():
    """`chown -R factmill /app` let the service user rewrite worker/ and alembic/ (and doubled the
    code's layer); only its data folder, also its home, is its own."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert "chown -R" not in dockerfile
    assert "chown factmill:factmill /app/var" in dockerfile and "--home /app/var" in dockerfile


def _pods() -> dict[str, dict]:
    """Each workload's pod template, by its name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in _k8s_docs()
        if d["kind"] in ("Deployment", "Job")
    }


def test_only_the_api_holds_the_admin_token_and_the_webhook_secrets():
    """Every pod took the whole Secret (the workers and beat refused to start without the API's
    secrets): a compromised worker, or Flower, held the bootstrap admin credential."""
    for name, pod in _pods().items():
        secrets = {
            ref["secretRef"]["name"] for c in pod["containers"] for ref in c["envFrom"] if "secretRef" in ref
        }
        if name == "factmill-api":
            assert secrets == {"factmill", "factmill-api"}, name
        elif name == "factmill-flower":
            assert secrets == {"factmill-flower"}, name
        else:
            assert secrets == {"factmill"}, name


def test_every_pod_runs_restricted_as_the_images_numeric_user():
    """No securityContext: a namespace enforcing the restricted Pod Security Standard created no pod, and
    runAsNonRoot could not verify the image's user, a name (the kubelet refused to start it)."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert "USER 10001:10001" in dockerfile and "--uid 10001" in dockerfile
    for name, pod in _pods().items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == 10001, name
        assert (
            context["seccompProfile"] == {"type": "RuntimeDefault"}
            and not pod["automountServiceAccountToken"]
        )
        for container in pod["containers"]:
            own = container["securityContext"]
            assert own["allowPrivilegeEscalation"] is False and own["capabilities"] == {"drop": ["ALL"]}, name


def test_a_worker_pod_counts_available_only_past_its_start():
    """With no readiness probe, a worker pod that exits at start (the schema not at head yet) counted
    available at once: a rollout swapped the single maintenance worker for a crash-looping one."""
    from worker.settings import Settings

    wait = Settings.model_fields["startup_wait_seconds"].default
    workers = [
        d
        for d in _k8s_docs()
        if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("factmill-worker-")
    ]
    assert workers and all(d["spec"]["minReadySeconds"] > wait for d in workers)


def test_compose_gives_the_apis_secrets_to_the_api_alone():
    """Every container took the webhook secret and the admin token through one shared environment:
    a compromised worker or Flower held the bootstrap admin credential."""
    for name, service in SERVICES.items():
        if "environment" not in service or name in ("postgres", "redis"):
            continue
        holds = {"FACTMILL_WEBHOOK_SECRET", "FACTMILL_ADMIN_TOKEN"} & set(service["environment"])
        assert bool(holds) == (name == "api"), name
    assert set(SERVICES["flower"]["environment"]) == {
        "FACTMILL_ENVIRONMENT",
        "FACTMILL_BROKER_URL",
        "FLOWER_BASIC_AUTH",
    }
