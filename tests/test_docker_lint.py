"""Lint for what cannot be built or run here (no Docker engine, no Slurm, no Apptainer):
hadolint on the Dockerfiles, shellcheck on every shell script of the repository and on the
Apptainer definition's scriptlets, and the cross-file facts a build would trip over (files the
images copy exist and get past the .dockerignore, compose starts the 2-node job, no key material
is committed)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import BIN, REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
SHELL_SCRIPTS = sorted({*DOCKER.glob("*.sh"), *(DOCKER / "slurm").glob("*"),
                        *(REPO / "examples").glob("*.sh"), REPO / ".ci" / "run"})
APPTAINER_DEF = DOCKER / "apptainer.def"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _tool(name: str) -> Path:
    tool = BIN / name
    if not tool.exists():
        pytest.fail(f"{tool} missing: it comes with the test extra (make setup)")
    return tool


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_rel)
@pytest.mark.system
def test_hadolint_clean(dockerfile: Path) -> None:
    result = subprocess.run([_tool("hadolint"), "--no-color", dockerfile], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_rel)
@pytest.mark.system
def test_shellcheck_clean(script: Path) -> None:
    result = subprocess.run([_tool("shellcheck"), "--external-sources", _rel(script)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Apptainer ---------------------------------------------------------------------------------

def _apptainer_sections() -> list[tuple[str, str]]:
    """(header line, body) of every %section, in file order, across all stages."""
    sections: list[tuple[str, str]] = []
    for line in APPTAINER_DEF.read_text().splitlines():
        if line.startswith("%"):
            sections.append((line.strip(), ""))
        elif re.match(r"^(Bootstrap|From|Stage):", line):
            sections.append(("header", ""))
        elif sections:
            sections[-1] = (sections[-1][0], sections[-1][1] + line + "\n")
    return sections


@pytest.mark.system
def test_apptainer_scriptlets_pass_shellcheck(tmp_path: Path) -> None:
    sections = _apptainer_sections()
    defaults = dict(line.strip().split("=", 1) for head, body in sections
                    if head == "%arguments" for line in body.splitlines() if line.strip())
    used = set(re.findall(r"{{\s*(\w+)\s*}}", APPTAINER_DEF.read_text()))
    assert used <= defaults.keys(), f"{{{{ }}}} variables without a default: {used - defaults.keys()}"
    scriptlets = [(head, body) for head, body in sections
                  if head.split()[0] in ("%post", "%test", "%runscript", "%environment")]
    assert [h for h, _ in scriptlets].count("%post") == 2  # build stage and runtime stage
    for i, (head, body) in enumerate(scriptlets):
        # Apptainer runs these with /bin/sh after filling in the {{ }} build arguments.
        text = re.sub(r"{{\s*(\w+)\s*}}", lambda m: defaults[m.group(1)], body)
        script = tmp_path / f"{i}-{head.strip('%').split()[0]}.sh"
        script.write_text("#!/bin/sh\n" + text)
        result = subprocess.run([_tool("shellcheck"), script], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"{head} of {_rel(APPTAINER_DEF)}:\n{result.stdout}"


def test_apptainer_copies_files_that_exist() -> None:
    for head, body in _apptainer_sections():
        if head == "%files":  # from the host (not `%files from STAGE`)
            for line in body.splitlines():
                if line.strip():
                    assert (REPO / line.split()[0]).exists(), line


# ---- Dockerfiles: what they copy ----------------------------------------------------------------

def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, glob) for c in candidates):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_rel)
def test_dockerfile_copies_exist_and_pass_its_dockerignore(dockerfile: Path) -> None:
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copies = [line.split()[1:] for line in dockerfile.read_text().splitlines()
              if line.startswith("COPY ") and "--from=" not in line]
    assert copies
    for words in copies:
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"{_rel(dockerfile)} copies missing {source}"
            assert not _ignored(source, patterns), f"{source} is excluded by {_rel(ignore_file)}"
    assert _ignored(".venv/bin/python", patterns)  # never send the multi-GB venv as context


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=_rel)
def test_runtime_stage_runs_as_non_root(dockerfile: Path) -> None:
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")


# ---- compose, secrets --------------------------------------------------------------------------

def test_compose_runs_horovodrun_across_two_ssh_nodes() -> None:
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"node1", "node2"} <= services.keys()
    for name in ("node1", "node2"):
        node = services[name]
        assert node["hostname"] == name
        assert node["environment"]["RINGFEED_SSHD"] == "1"
        assert (DOCKER / node["build"]["context"] / node["build"]["dockerfile"]).exists()
        assert any(v.endswith(":/var/lib/ringfeed/ssh") for v in node["volumes"])
    command = services["node1"]["command"]
    assert command[:5] == ["horovodrun", "-np", "2", "-H", "node1:1,node2:1"]
    assert command[command.index("-p") + 1] == "2222"
    assert command[command.index("--network-interface") + 1] == "eth0"
    assert services["node1"]["environment"]["RINGFEED_WAIT_FOR_SSH"] == "node2"


def test_no_key_material_committed_under_docker() -> None:
    for path in DOCKER.rglob("*"):
        if path.is_file():
            assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), _rel(path)
