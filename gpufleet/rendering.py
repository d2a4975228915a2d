"""gpufleet's one Jinja environment, for every file it writes (templates/etc, templates/usr) and
the HTML report (templates/report): strict about missing values, block tags leave no blank lines,
HTML templates (*.html.j2) autoescaped and nothing else (a config file must be written as is)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import jinja2

from gpufleet.apt_policy import UNATTENDED_ORIGINS


def _templates() -> Path:
    """templates/: installed as gpufleet/templates (pyproject.toml's package-dir), at the top of
    a checkout."""
    here = Path(__file__).resolve().parent
    installed = here / "templates"
    return installed if installed.is_dir() else here.parent / "templates"


TEMPLATES = _templates()


def _systemd_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
    autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default_for_string=False),
)
_ENV.filters["sh"] = shlex.quote  # a value in a shell script: one word, quoted where it needs it
_ENV.filters["systemd"] = _systemd_quote  # a value in a unit file: one double-quoted word
# The same security origins wherever the unattended-upgrades file is rendered.
_ENV.globals["unattended_origins"] = list(UNATTENDED_ORIGINS)


def render(template: str, **context: Any) -> str:
    """`template` (a path under templates/) rendered with `context`."""
    return _ENV.get_template(template).render(**context)
