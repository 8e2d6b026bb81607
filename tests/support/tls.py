"""Test certificates made with the openssl command (tests that need them skip without it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs openssl to make certificates"
)


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


def issue(directory: Path, name: str, *, days: int = 1, san: str | None = None) -> None:
    """A new key and certificate `name`.pem / .key signed by the CA in `directory` (its next
    serial), with the extensions of `name`.ext, or those of a client certificate for `san`."""
    if san is not None:
        (directory / f"{name}.ext").write_text(
            "extendedKeyUsage=clientAuth\n" + (f"subjectAltName={san}\n" if san else "")
        )
    _openssl(directory, "req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(
        directory,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"),
        *("-out", f"{name}.pem", "-days", str(days), "-extfile", f"{name}.ext"),
    )


def publish(directory: Path, live: Path, names: Mapping[str, str]) -> None:
    """Point `live` (a link, as in a Kubernetes secret volume) at a new folder holding copies
    of `directory`'s files: `names` maps each file's name in `live` to its name in `directory`.
    The files change together: the link is replaced in one rename."""
    version = 0
    while (target := live.parent / f"{live.name}.v{version}").exists():
        version += 1
    target.mkdir()
    for published, source in names.items():
        shutil.copyfile(directory / source, target / published)
    link = live.parent / f"{live.name}.link"
    link.symlink_to(target.name)
    os.replace(link, live)


def make_certs(directory: Path, clients: Mapping[str, str] | None = None) -> None:
    """ca.pem, a server certificate for IP 127.0.0.1, and client certificates it signs: `client`
    by default, else one per name of `clients` with that subjectAltName value ("" for none,
    e.g. "URI:spiffe://kvshuttle/router,DNS:router.kvshuttle.svc")."""

    _openssl(
        directory,
        "req",
        "-x509",
        *_KEY,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
    )
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    issue(directory, "server")
    for name, san in (clients if clients is not None else {"client": ""}).items():
        issue(directory, name, san=san)
