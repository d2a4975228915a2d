"""NVIDIA driver, CUDA and cuDNN. Placeholder until issue #4 lands: it changes nothing and says so."""
from pyinfra.api import deploy

from operations.placeholder import not_implemented


@deploy("NVIDIA driver, CUDA and cuDNN")
def driver():
    not_implemented(
        name="Not implemented yet (issue #4): nothing is done here",
        area="NVIDIA driver, CUDA and cuDNN",
        issue=4,
    )
