"""The deployment: docker-compose.yml's shape, and its exact start command run here against a real store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from kvledger.connector.ports import free_loopback_ports
from tests.api.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _compose() -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load(COMPOSE.read_text())
    return data


def _start_command() -> str:
    service = _compose()["services"]["kvledger"]  # type: ignore[index]
    shell, flag, command = service["command"]
    assert (shell, flag) == ("sh", "-c")
    return str(command)


def test_compose_file_is_valid_for_docker_compose() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"the docker client here has no compose plugin: {probe.stderr.strip()[:120]}")
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_compose_runs_postgres_with_a_healthcheck_and_a_volume() -> None:
    services = _compose()["services"]
    postgres, service = services["postgres"], services["kvledger"]  # type: ignore[index]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any(volume.endswith(":/var/lib/postgresql/data") for volume in postgres["volumes"])
    assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert service["environment"]["KVLEDGER_DB"].startswith("postgresql+psycopg://")
    command = _start_command()
    assert command.index("kvledger db upgrade --db") < command.index("kvledger serve --host 0.0.0.0")


def test_compose_runs_nats_with_a_healthcheck_its_image_can_run() -> None:
    """The nats image's healthcheck runs `wget` in a shell: the plain `nats:` tags are built FROM scratch
    (the server binary alone), so a CMD-SHELL check there never passes and the service over it never starts."""
    services = _compose()["services"]
    nats, service = services["nats"], services["kvledger-nats"]  # type: ignore[index]
    kind, *check = nats["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "healthz" in " ".join(check)
    assert nats["image"].startswith("nats:") and nats["image"].endswith("-alpine"), nats["image"]
    assert "-js" in nats["command"]
    assert service["depends_on"]["nats"]["condition"] == "service_healthy"
    assert service["environment"]["KVLEDGER_DB"].startswith("nats://nats:4222/")


def test_the_compose_start_command_migrates_and_serves(tmp_path: Path) -> None:
    """The container's command, verbatim but for loopback and a free port, over a new SQLite file."""
    (port,) = free_loopback_ports(1)
    # Compose turns `$$` into `$` before the shell sees the command; do the same.
    command = _start_command().replace("$$", "$")
    command = command.replace("--host 0.0.0.0", "--host 127.0.0.1").replace("--port 8000", f"--port {port}")
    env = os.environ | {"KVLEDGER_DB": f"sqlite:///{tmp_path}/ledger.db", "KVLEDGER_TOKEN": "t"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    process = subprocess.Popen(["sh", "-c", command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else "exited"
        try:
            return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, polls_max=1500)
        assert httpx.get(f"{base}/", timeout=5).status_code == 200
        assert "kvledger_live_transfers 0.0" in httpx.get(f"{base}/metrics", timeout=5).text
    finally:
        process.terminate()
        process.wait(timeout=30)
