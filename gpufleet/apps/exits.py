"""Every command's exit codes: one table, shown in each command's `--help` (its epilog) and in
docs/commands.md (gpufleet/apps/commands_doc.py)."""
from __future__ import annotations

from gpufleet.plans.health import ACTION

#: command (its installed name; the checkout's tools/* name where there is none) -> (code, meaning)
EXIT_CODES: dict[str, tuple[tuple[int, str], ...]] = {
    "gpufleet-deploy": (
        (0, "every host done (pyinfra's exit code)"),
        (1, "a host failed or was not reached, or pyinfra stopped (pyinfra's exit code)"),
        (2, "usage: no inventory file, an unknown area, more than one area (checked before pyinfra starts)"),
        (4, "every host done, but a host failed its acceptance after its first converge: drained, named with "
            "its measurement and fix (docs/acceptance.md)"),
    ),
    "gpufleet-rollout": (
        (0, "done: every host of the rollout is at its target"),
        (1, "stopped: a host failed, --max-fail was passed, not confirmed, or no -y without a terminal "
            "(dry run only)"),
        (2, "usage: bad arguments, inventory, --limit/--exclude/--data or a target that does not fit"),
        (3, "hosts left: busy, reboot-pending or not reached; run again to resume"),
    ),
    "gpufleet-rollback": (
        (0, "every named host rolled back (with --dry-run: every host answers)"),
        (1, "a host failed or was busy, not confirmed, or no -y without a terminal (dry run only)"),
        (2, "usage: bad arguments, a host not in the inventory, no manifest or one gpufleet did not write"),
    ),
    "gpufleet-report": (
        (0, "every host reached and passes validation"),
        (1, "a host not reached, not read or not passing validation"),
        (2, "usage: bad arguments, no such inventory file, an inventory with no host"),
    ),
    "gpufleet-compat": (
        (0, "the GPUs and OS fit: what gpufleet would install is printed"),
        (2, "usage: bad arguments"),
        (3, "refused: the answer names why and the key that fixes it"),
    ),
    "gpufleet-health": (
        (0, f"nothing needs action (every finding's class below {ACTION})"),
        (1, "something needs action, a host was not read, or a diagnostic asked for did not pass"),
        (2, "usage: bad arguments, no such inventory file, an inventory with no host"),
    ),
    "tools/compat-upstream": (
        (0, "every row of compat.yaml agrees with the upstream files read"),
        (1, "findings: rows that disagree or are missing"),
        (2, "usage: not a folder, or no upstream file in it"),
    ),
}


def epilog(command: str) -> str:
    """`exit codes: 0 ...; 1 ...`: the line each command's --help ends with."""
    return "exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES[command])
