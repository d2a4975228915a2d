"""Docker engine and NVIDIA container toolkit. Placeholder until issue #5 lands: it changes nothing and says so."""
from pyinfra.api import deploy

from operations.placeholder import not_implemented


@deploy("Docker engine and NVIDIA container toolkit")
def docker():
    not_implemented(
        name="Not implemented yet (issue #5): nothing is done here",
        area="Docker engine and NVIDIA container toolkit",
        issue=5,
    )
