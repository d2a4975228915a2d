"""SSH hardening and firewall. Placeholder until issue #7 lands: it changes nothing and says so."""
from pyinfra.api import deploy

from operations.placeholder import not_implemented


@deploy("SSH hardening and firewall")
def hardening():
    not_implemented(
        name="Not implemented yet (issue #7): nothing is done here",
        area="SSH hardening and firewall",
        issue=7,
    )
