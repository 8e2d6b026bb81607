"""Test certificates made with the openssl command (tests that need them skip without it)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs openssl to make certificates"
)


def make_certs(directory: Path, clients: Mapping[str, str] | None = None) -> None:
    """ca.pem, a server certificate for IP 127.0.0.1, and client certificates it signs: `client`
    by default, else one per name of `clients` with that subjectAltName value ("" for none,
    e.g. "URI:spiffe://kvshuttle/router,DNS:router.kvshuttle.svc")."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    extensions = {"server": "subjectAltName=IP:127.0.0.1\n"}
    for name, san in (clients if clients is not None else {"client": ""}).items():
        extensions[name] = "extendedKeyUsage=clientAuth\n" + (f"subjectAltName={san}\n" if san else "")
    for name, ext in extensions.items():
        (directory / f"{name}.ext").write_text(ext)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl(
            *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"),
            *("-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext"),
        )
