"""Throwaway TLS files for local Redis servers (the HA tests; people trying TLS locally).

``make_certs(folder)`` writes a private CA and a server certificate it signed for ``127.0.0.1``
(subject alternative name ``IP:127.0.0.1``, so clients can verify the host) with the
``openssl`` command-line tool, valid for two days. Never use them for anything real: the CA's
key sits next to them, unencrypted.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A CA certificate and a server certificate/key pair it signed (PEM files)."""

    ca_cert: Path
    cert: Path
    key: Path

    def server_args(self) -> list[str]:
        """``redis-server`` options that load these files (the server's side, and its own
        outgoing TLS connections: replication, sentinels)."""
        return ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca_cert)]  # fmt: skip

    def conf_lines(self) -> str:
        """The same as lines of a configuration file (a sentinel's)."""
        return (
            f"tls-cert-file {self.cert}\ntls-key-file {self.key}\ntls-ca-cert-file {self.ca_cert}\n"
        )


def make_certs(folder: Path) -> TlsFiles:
    """A CA and a ``127.0.0.1`` server certificate in ``folder`` (created if need be);
    ``RuntimeError`` if ``openssl`` is missing or fails."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = folder / "ca.key", folder / "ca.crt"
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.crt"
    ext = folder / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_cert,
         "-subj", "/CN=tokenfleet test CA", "-days", "2"],
        ["req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run(
            [openssl, *map(str, step)], capture_output=True, timeout=60, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"openssl {step[0]} failed: {done.stderr.decode(errors='replace')}")
    return TlsFiles(ca_cert=ca_cert, cert=cert, key=key)
