"""testinfra handles on test hosts: checks read real state over SSH, not gpufleet's output."""
import testinfra

from testing import testhosts


def remote(host: testhosts.Host):
    """A testinfra handle that runs its checks as root: logged in as the host's SSH user, through
    sudo unless that is root (the operator's shape: root may not log in after hardening). That
    sudo asks for the deploy user's password: sudo -S reads it from the channel's stdin, the
    way testhosts.ssh gives it (never a command line)."""
    sudo = host.ssh_user != "root"
    handle = testinfra.get_host(f"paramiko://{host.ssh_user}@{host.address}",
                                ssh_identity_file=host.ssh_key, sudo=sudo)
    if sudo:
        _password_on_stdin(handle.backend, host)
    if host.netns:
        # A private-network host: connect now, from its client namespace (the socket stays there).
        with testhosts.in_netns(host.netns):
            handle.backend.client  # noqa: B018
    return handle


def _password_on_stdin(backend, host: testhosts.Host) -> None:
    backend.get_sudo_command = lambda command, sudo_user: backend.quote("sudo -S -k -p '' /bin/sh -c %s", command)

    def exec_command(command: bytes) -> tuple[int, bytes, bytes]:
        transport = backend.client.get_transport()
        channel = transport.open_session()
        if backend.get_pty:
            channel.get_pty()
        channel.exec_command(command)
        channel.sendall(testhosts.sudo_stdin(host, "").encode())
        channel.shutdown_write()
        stdout = b"".join(channel.makefile("rb"))
        stderr = b"".join(channel.makefile_stderr("rb"))
        return channel.recv_exit_status(), stdout, stderr

    backend._exec_command = exec_command
