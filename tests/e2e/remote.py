"""testinfra handles on test hosts: checks read real state over SSH, not gpufleet's output."""
import testinfra

from testing import testhosts


def remote(host: testhosts.Host):
    return testinfra.get_host(f"paramiko://{host.ssh_user}@{host.address}",
                              ssh_identity_file=host.ssh_key)
