"""The deploy files, one per area, run by pyinfra (`pyinfra INVENTORY deploys/<area>.py`)."""
from __future__ import annotations

from pathlib import Path

#: This folder: deploys/ at the top of a checkout, gpufleet/deploys in an installed wheel
#: (pyproject.toml's package-dir). The applications find the deploy files here
#: (gpufleet/apps/commands.py, gpufleet/apps/report/gather.py).
FOLDER = Path(__file__).resolve().parent
