"""Short operation names, with their reasons kept beside them.

pyinfra's results table is as wide as its longest row, `deploy name | operation name`, so the
names are short, as pyinfra's own are ("Install packages"): at most NAME_LIMIT characters for an
operation, DEPLOY_NAME_LIMIT for a deploy (tests/unit/test_operation_names.py). What an operation
does and why is `explained`'s second argument, next to the operation: `pyinfra -v` logs it for
each host as the operation is planned (as it logs a no-op's reason), and docs/operations.md is
generated from these calls (gpufleet/apps/operations_doc.py, `tools/operations-doc`).
"""
from __future__ import annotations

import logging

from pyinfra import logger
from pyinfra.context import ctx_host, ctx_state

NAME_LIMIT = 60
DEPLOY_NAME_LIMIT = 24


def explained(name: str, why: str) -> str:
    """`name`, after logging `why` for the current host: at info level under `pyinfra -v` (where
    pyinfra prints its own no-op reasons), at debug level otherwise."""
    if ctx_host.isset() and ctx_state.isset():
        host, state = ctx_host.get(), ctx_state.get()
        level = logging.INFO if state.print_noop_info else logging.DEBUG
        if logger.isEnabledFor(level):  # planning calls this per host and operation: no text unless shown
            logger.log(level, f"{host.print_prefix}{name}: {why}")
    return name
