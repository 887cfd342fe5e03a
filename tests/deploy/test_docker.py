"""deploy/docker, checked by hadolint (the Dockerfile linter, with ShellCheck for the RUN lines)."""

import re

import pytest

from tests.deploy.tools import DEPLOY, assert_clean, assert_refused, run, tool

DOCKERFILES = sorted(path for path in (DEPLOY / "docker").glob("Dockerfile*") if path.suffix != ".dockerignore")


def hadolint(path) -> object:
    return run([tool("hadolint"), "--no-color", str(path)])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    assert_clean(hadolint(dockerfile))


def test_both_images_are_there():
    assert [path.name for path in DOCKERFILES] == ["Dockerfile", "Dockerfile.agent"]
    assert "FROM python:3.11-slim" in (DEPLOY / "docker/Dockerfile").read_text()
    # The release the console's Ascend engine set follows (requirements/engine-ascend.txt, Makefile).
    assert "quay.io/ascend/vllm-ascend:v0.23.0" in (DEPLOY / "docker/Dockerfile.agent").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_no_secret_is_baked_in(dockerfile):
    """Settings that are secrets come at run time (NAME or NAME_FILE); an image keeps every ENV and ARG."""
    for line in dockerfile.read_text().splitlines():
        if line.startswith(("ENV ", "ARG ")):
            assert not re.search(r"SECRET|PASSWORD|TOKEN|DATABASE_URL|REDIS_URL", line), line


@pytest.mark.parametrize(
    "change, rule",
    [
        (("USER 10001:10001", "USER root"), "DL3002"),  # the last USER is root
        (("COPY . .", "ADD . ."), "DL3020"),
        (("RUN python -m venv", "RUN cd /tmp && python -m venv"), "DL3003"),  # cd in RUN, not WORKDIR
    ],
)
def test_hadolint_refuses_a_broken_dockerfile(tmp_path, change, rule):
    broken = tmp_path / "Dockerfile"
    broken.write_text((DEPLOY / "docker/Dockerfile").read_text().replace(*change, 1))
    assert_refused(hadolint(broken), rule)
