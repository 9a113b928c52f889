"""The Kubernetes manifests under infra/k8s start commands and read settings that exist.

Each container's ``python -m kvflow ...`` command is parsed by the real CLI
(an unknown command or option fails), and each ``KVFLOW_*`` variable it sets
is a :class:`~kvflow.settings.Settings` field or an option's environment variable.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvflow.cli import app
from kvflow.settings import Settings

K8S = Path(__file__).resolve().parents[1] / "infra" / "k8s"


def containers() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            found += [(f"{path.name}:{c['name']}", c) for c in spec.get("containers", [])]
    return found


def option_envvars(group: click.Group) -> set[str]:
    names: set[str] = set()
    for command in group.commands.values():
        if isinstance(command, click.Group):
            names |= option_envvars(command)
            continue
        for param in command.params:
            envvar = param.envvar
            names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


def test_every_manifest_runs_a_kvflow_command():
    assert {name.split(":")[0] for name, _ in containers()} >= {"router.yaml", "bridge.yaml", "workers.yaml",
                                                                 "planner.yaml"}


@pytest.mark.parametrize("name,container", containers(), ids=[n for n, _ in containers()])
def test_manifest_commands_and_variables_exist(name, container):
    command = container["command"]
    assert command[:3] == ["python", "-m", "kvflow"], name
    result = CliRunner().invoke(app, [*command[3:], "--help"])
    assert result.exit_code == 0, f"{name}: {' '.join(command)}\n{result.output}"
    known = {f"KVFLOW_{field.upper()}" for field in Settings.model_fields} | option_envvars(typer.main.get_command(app))
    unknown = [e["name"] for e in container.get("env", []) if e["name"].startswith("KVFLOW_") and e["name"] not in known]
    assert not unknown, f"{name} sets variables nothing reads: {unknown}"
