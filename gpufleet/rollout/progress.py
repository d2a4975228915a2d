"""What tools/rollout tells the operator while it runs, as pure functions: the heartbeat line of
a wave (elapsed time and an estimate of the rest) and the confirmation before it drains (or,
with no terminal to ask on and no -y, the refusal to go past the dry run)."""
from __future__ import annotations

import math
from typing import Mapping, TextIO


def duration(seconds: float) -> str:
    """42s, 4m12s, 1h05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def planned_waves(batch_sizes: list[int], max_unavailable: int) -> int:
    """Waves the plan needs: each batch in waves of at most max_unavailable hosts."""
    return sum(math.ceil(n / max(max_unavailable, 1)) for n in batch_sizes if n > 0)


def estimate_left(past_waves: list[float], wave: int, waves: int, wave_elapsed: float) -> float | None:
    """Seconds left for the whole rollout while wave `wave` (1-based) of `waves` has run for
    `wave_elapsed`: a wave takes about as long as the finished ones did (its hosts run in
    parallel, so a wave's length hardly depends on how many it has). None before any wave
    finished: there is nothing to go by."""
    if not past_waves:
        return None
    mean = sum(past_waves) / len(past_waves)
    return max(mean - wave_elapsed, 0.0) + mean * max(waves - wave, 0)


def heartbeat_line(wave: int, waves: int, done: int, total: int, elapsed: float, left: float | None) -> str:
    """'wave 2/4: 3 of 8 hosts done, 4m12s elapsed, about 9m left'."""
    line = f"wave {wave}/{max(waves, wave)}: {done} of {total} hosts done, {duration(elapsed)} elapsed"
    if left is None:
        return line + ", an estimate after the first wave"
    if left < 60:
        return line + (", about a minute left" if left > 0 else ", about to finish")
    return line + f", about {round(left / 60)}m left"


#: what pyinfra's -y reads from the environment, and the values click takes for a flag there
YES_ENV = "PYINFRA_YES"
_TRUE, _FALSE = ("1", "true", "t", "yes", "y", "on"), ("0", "false", "f", "no", "n", "off", "")


def env_yes(environ: Mapping[str, str]) -> bool:
    """PYINFRA_YES as `pyinfra` reads it; a value it would refuse is a ValueError (a typo must
    not be read as a no by one tool and a yes by another)."""
    value = environ.get(YES_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{YES_ENV}={environ[YES_ENV]!r} is not a yes or a no: allowed {', '.join(_TRUE)} "
                     f"or {', '.join(v for v in _FALSE if v)}")


def is_terminal(stdin: TextIO | None) -> bool:
    """Someone can be asked on stdin: a terminal (a closed stdin is None, or raises, here)."""
    try:
        return stdin is not None and stdin.isatty()
    except ValueError:   # closed
        return False


def unattended_line(tool: str, verb: str) -> str:
    """What a run without -y and without a terminal says after its dry run."""
    return (f"no terminal to ask on (stdin is not one: cron, CI, a script) and no -y: that was the dry run, "
            f"nothing changed. To {verb} as shown, run {tool} again with -y (or {YES_ENV}=1 in its environment)")


def confirmed(question: str, assume_yes: bool, stdin: TextIO | None, out: TextIO) -> bool:
    """Ask `question` (y/N) on a terminal; -y goes on without asking. Without a terminal on
    stdin nothing is asked and nothing is confirmed (pyinfra's question fails there too: a cron
    or CI job never starts changing a fleet by accident). Anything but y/yes is a no."""
    if assume_yes:
        return True
    if stdin is None or not is_terminal(stdin):
        return False
    out.write(f"{question} [y/N] ")
    out.flush()
    answer = stdin.readline()
    if not getattr(out, "isatty", lambda: False)():
        out.write("\n")   # the answer was echoed on the terminal, not into this output
    return answer.strip().lower() in ("y", "yes")
