"""The Jinja environment of the configuration files gpufleet writes (templates/etc): strict
about missing values, block tags leave no blank lines. The tuning area and the HTML report
still have their own (gpufleet/tuning.py, gpufleet/report/render.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from gpufleet.apt_policy import UNATTENDED_ORIGINS

TEMPLATES = Path(__file__).resolve().parent / "templates"  # templates/, in a checkout and a wheel

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
)
# The same security origins wherever the unattended-upgrades file is rendered.
_ENV.globals["unattended_origins"] = list(UNATTENDED_ORIGINS)


def render(template: str, **context: Any) -> str:
    """`template` (a path under templates/) rendered with `context`."""
    return _ENV.get_template(template).render(**context)
