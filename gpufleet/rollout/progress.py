"""What tools/rollout tells the operator while it runs, as pure functions: the heartbeat line of
a wave (elapsed time and an estimate of the rest) and the confirmation before it drains."""
from __future__ import annotations

import math
from typing import TextIO


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


def confirmed(question: str, assume_yes: bool, stdin: TextIO, out: TextIO) -> bool:
    """Ask `question` (y/N) on a terminal; -y or no terminal on stdin (scripts, CI) goes on
    without asking. Anything but y/yes is a no."""
    if assume_yes or not stdin.isatty():
        return True
    out.write(f"{question} [y/N] ")
    out.flush()
    answer = stdin.readline()
    if not getattr(out, "isatty", lambda: False)():
        out.write("\n")   # the answer was echoed on the terminal, not into this output
    return answer.strip().lower() in ("y", "yes")
