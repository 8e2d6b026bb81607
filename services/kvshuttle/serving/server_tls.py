"""A server's TLS credentials from its certificate, key and client CA files, re-read when they
change: a renewed certificate (cert-manager writes it into the mounted secret) is served without
a restart.

gRPC asks `fetch()` at every TLS handshake (on one of its own threads): it answers None while
the files are as they were (the current configuration stays), and a new configuration once
they changed. Connections already up keep the certificate they were opened with; new ones get
the new certificate. Files read while being replaced (their version changed during the read),
or that fail to load, keep the current configuration, and the next handshake tries again.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import structlog

__all__ = ["ReloadingServerCertificates"]

_log = structlog.get_logger("kvshuttle.serving")

_FileVersion = tuple[int, int, int]  # inode, size, mtime (ns) of the file a path leads to


def _version(path: Path) -> _FileVersion:
    stat = path.stat()  # follows links: a Kubernetes secret volume swaps them
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


class ReloadingServerCertificates:
    """`credentials()` for a server's secure port, following `cert`, `key` and `client_ca`
    (None: no client certificates asked for)."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._paths = (cert, key) if client_ca is None else (cert, key, client_ca)
        self._client_ca = client_ca
        self._lock = threading.Lock()
        self._versions: tuple[_FileVersion, ...] = ()
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        """Reads the files now (raises OSError when one is missing)."""
        loaded = self._load()
        if loaded is None:
            raise OSError(f"the TLS files {', '.join(map(str, self._paths))} changed while being read")
        configuration, self._versions = loaded
        return grpc.dynamic_ssl_server_credentials(
            configuration,
            self.fetch,  # type: ignore[arg-type]  # None (no change) is documented, not in the stubs
            require_client_authentication=self._client_ca is not None,
        )

    def _load(self) -> tuple[grpc.ServerCertificateConfiguration, tuple[_FileVersion, ...]] | None:
        before = tuple(_version(p) for p in self._paths)
        cert, key = self._paths[0].read_bytes(), self._paths[1].read_bytes()
        client_ca = None if self._client_ca is None else self._client_ca.read_bytes()
        if tuple(_version(p) for p in self._paths) != before:
            return None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca), before

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate_configuration_fetcher: None keeps the current configuration."""
        with self._lock:
            try:
                if tuple(_version(p) for p in self._paths) == self._versions:
                    return None
                loaded = self._load()
            except OSError as exc:
                _log.warning("server.tls_reload_failed", error=str(exc), keeping="the current certificate")
                return None
            if loaded is None:
                return None
            configuration, self._versions = loaded
            self.reloads += 1
            _log.info("server.tls_reloaded", cert=str(self._paths[0]), reloads=self.reloads)
            return configuration
