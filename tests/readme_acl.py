"""The README's Redis ACL roles as commands (README, "Redis ACL roles"): what
tests/worker/test_acl_roles.py (standalone) and tests/ha/test_cluster_acl.py (cluster) run."""

from __future__ import annotations

import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_acl_commands(prefix: str, passwords: dict[str, str]) -> list[list[str]]:
    """The README's ``ACL SETUSER`` commands for ``prefix``, with the given passwords."""
    block = README.read_text().split("<!-- acl-roles:", 1)[1]
    block = block.split("```sh\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip():
            continue
        argv = shlex.split(line)
        assert argv[:3] == ["redis-cli", "ACL", "SETUSER"], line
        user = argv[3]
        argv = [a.replace("tokenfleet:", f"{prefix}:") for a in argv[1:]]
        out.append([f">{passwords[user]}" if a.startswith(">") else a for a in argv])
    return out
