"""A plan's "not on this host", as data: the one `Refusal` of every plan, which lives in
gpufleet/config/failures.py (area, key, reason, fix, allowed); re-exported here for the Docker
and hardening plans, which import it from this module."""
from __future__ import annotations

from gpufleet.config.failures import Refusal as Refusal
