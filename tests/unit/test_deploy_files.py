"""docker-compose and the Kubernetes manifests name real commands, queues and health checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from worker.cli import app
from worker.jobs.registry import queues

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
        help_text = result.output
        for flag in command[1::2]:
            assert flag in help_text, f"{flag} is not an option of `factmill worker`"
