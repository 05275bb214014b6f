"""The documented Redis ACL roles as commands (docs/security.md, "Redis ACL roles"): what
tests/worker/test_acl_roles.py (standalone) and tests/ha/test_cluster_acl.py (cluster) run."""

from __future__ import annotations

import shlex
from pathlib import Path

ACL_PAGE = Path(__file__).resolve().parents[1] / "docs" / "security.md"


def documented_acl_commands(
    prefix: str, passwords: dict[str, str], *, cluster: bool = False
) -> list[list[str]]:
    """The page's ``ACL SETUSER`` commands for ``prefix``, with the given passwords; with
    ``cluster``, each pattern rewritten by the page's cluster rule (a key pattern for the
    fleet's slot ``{prefix}`` and one for every lane ``{prefix|*}``, a channel pattern for every
    lane; ``{prefix}:lanes`` added for the producer and the gateway)."""
    block = ACL_PAGE.read_text().split("<!-- acl-roles:", 1)[1]
    block = block.split("```sh\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip():
            continue
        argv = shlex.split(line)
        assert argv[:3] == ["redis-cli", "ACL", "SETUSER"], line
        user = argv[3]
        if cluster:
            argv = [argv[1], *[b for a in argv[2:] for b in _cluster_patterns(prefix, a)]]
            if user in ("tf-producer", "tf-gateway"):
                argv.append(f"~{{{prefix}}}:lanes")
        else:
            argv = [a.replace("tokenfleet:", f"{prefix}:") for a in argv[1:]]
        out.append([f">{passwords[user]}" if a.startswith(">") else a for a in argv])
    return out


def _cluster_patterns(prefix: str, arg: str) -> list[str]:
    """The page's cluster rule for one ``ACL SETUSER`` argument (others are kept)."""
    for head in ("%R~", "~"):
        if arg.startswith(head + "tokenfleet:"):
            tail = arg[len(head + "tokenfleet:") :]
            return [f"{head}{{{prefix}}}:{tail}", f"{head}{{{prefix}|*}}:{tail}"]
    if arg.startswith("&tokenfleet:"):
        return [f"&{{{prefix}|*}}:{arg[len('&tokenfleet:') :]}"]
    return [arg]
