"""testinfra handles on test hosts: checks read real state over SSH, not gpufleet's output."""
import testinfra

from testing import testhosts


def remote(host: testhosts.Host):
    handle = testinfra.get_host(f"paramiko://{host.ssh_user}@{host.address}",
                                ssh_identity_file=host.ssh_key)
    if host.netns:
        # A private-network host: connect now, from its client namespace (the socket stays there).
        with testhosts.in_netns(host.netns):
            handle.backend.client  # noqa: B018
    return handle
