"""GPU persistence, clocks and environment profiles. Placeholder until issue #6 lands: it changes nothing and says so."""
from pyinfra.api import deploy

from operations.placeholder import not_implemented


@deploy("GPU persistence, clocks and environment profiles")
def tuning():
    not_implemented(
        name="Not implemented yet (issue #6): nothing is done here",
        area="GPU persistence, clocks and environment profiles",
        issue=6,
    )
