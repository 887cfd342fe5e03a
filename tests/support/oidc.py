"""A real OpenID provider for the OIDC single sign-on tests: panva's oidc-provider 9 (OpenID Certified) from the
npm registry, installed by `npm ci` into tests/support/oidc_provider/node_modules (the Makefile's `sso-servers`) and
run by node as the test's child process (tests/support/oidc_provider/provider.mjs) on a free port of 127.0.0.1."""

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT
from tests.support.accounts import PASSWORD
from tests.support.gateway import free_port

PROVIDER_DIR = ROOT / "tests" / "support" / "oidc_provider"
CLIENT_ID, CLIENT_SECRET = "llm-console", "console-client-secret-for-tests-only"
# The provider's people, as the tests start them: erin is an Operator through ml-ops, frank is in no mapped group.
PEOPLE = {
    "erin": {"password": PASSWORD, "email": "erin@idp.test", "groups": ["ml-ops", "everyone"]},
    "frank": {"password": PASSWORD, "email": "frank@idp.test", "groups": ["everyone"]},
}


@dataclass
class OpenIdProvider:
    issuer: str
    users_file: Path
    metadata: dict

    def set_groups(self, username: str, groups: list[str]) -> None:
        people = json.loads(self.users_file.read_text())
        people[username]["groups"] = groups
        self.users_file.write_text(json.dumps(people))

    def console_env(self) -> dict[str, str]:
        """The variables an operator sets for this provider (docs/sso-and-teams.md), from its discovery document."""
        return {
            "OIDC_RP_CLIENT_ID": CLIENT_ID,
            "OIDC_RP_CLIENT_SECRET": CLIENT_SECRET,
            "OIDC_OP_AUTHORIZATION_ENDPOINT": self.metadata["authorization_endpoint"],
            "OIDC_OP_TOKEN_ENDPOINT": self.metadata["token_endpoint"],
            "OIDC_OP_USER_ENDPOINT": self.metadata["userinfo_endpoint"],
            "OIDC_OP_JWKS_ENDPOINT": self.metadata["jwks_uri"],
            "OIDC_OP_LOGOUT_ENDPOINT": self.metadata["end_session_endpoint"],
        }


@pytest.fixture(scope="module")
def openid_provider(live_server, tmp_path_factory):
    node = shutil.which("node")
    if node is None or not (PROVIDER_DIR / "node_modules" / "oidc-provider").is_dir():
        pytest.skip("node or oidc-provider missing: the Makefile's sso-servers (apt-get install nodejs npm; npm ci)")
    workdir = tmp_path_factory.mktemp("oidc")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    users_file = workdir / "people.json"
    users_file.write_text(json.dumps(PEOPLE))
    config = workdir / "provider.json"
    config.write_text(
        json.dumps(
            {
                "issuer": issuer,
                "port": port,
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "redirect_uri": f"{live_server.url}/oidc/callback/",
                "post_logout_redirect_uri": f"{live_server.url}/login/",
                "users_file": str(users_file),
                "cookie_key": os.urandom(16).hex(),
            }
        )
    )
    log = (workdir / "provider.log").open("wb")
    proc = subprocess.Popen(
        [node, str(PROVIDER_DIR / "provider.mjs"), str(config)],
        cwd=PROVIDER_DIR,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metadata = _discovery(proc, issuer, workdir / "provider.log")
        yield OpenIdProvider(issuer=issuer, users_file=users_file, metadata=metadata)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()


def _discovery(proc, issuer: str, log: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"oidc-provider exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{issuer}/.well-known/openid-configuration", timeout=2).raise_for_status().json()
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"oidc-provider did not answer at {issuer} within {timeout} s: {log.read_text()[-3000:]}")
