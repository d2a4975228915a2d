"""testinfra handles on test hosts: checks read real state over SSH, not gpufleet's output."""
import testinfra

from testing import testhosts


def remote(host: testhosts.Host):
    """A testinfra handle that runs its checks as root: logged in as the host's SSH user, through
    sudo unless that is root (the operator's shape: root may not log in after hardening)."""
    handle = testinfra.get_host(f"paramiko://{host.ssh_user}@{host.address}",
                                ssh_identity_file=host.ssh_key, sudo=host.ssh_user != "root")
    if host.netns:
        # A private-network host: connect now, from its client namespace (the socket stays there).
        with testhosts.in_netns(host.netns):
            handle.backend.client  # noqa: B018
    return handle
