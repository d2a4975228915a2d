"""An honest stand-in for a deploy that is not written yet."""
from pyinfra import host
from pyinfra.api import operation


@operation()
def not_implemented(area: str, issue: int):
    """Do nothing, and say so: never report success for work that was not done."""
    host.noop(f"{area} is not implemented yet (issue #{issue}); nothing was changed")
    return
    yield  # pragma: no cover - makes this function a generator, as pyinfra requires
