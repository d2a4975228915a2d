"""Plain pyinfra, five tasks, no gpufleet: the yardstick bench/side_by_side.py runs against
deploys/all.py on the same hosts (pyinfra's own fact path, one command per fact)."""
from io import StringIO

from pyinfra.operations import apt, files, systemd

apt.packages(name="curl is installed", packages=["curl"])
files.directory(name="A directory", path="/etc/gpufleet-bench-plain", mode="755")
files.put(name="A file in it", src=StringIO("plain pyinfra no-op\n"), dest="/etc/gpufleet-bench-plain/marker", mode="644")
files.line(name="A line in that file", path="/etc/gpufleet-bench-plain/marker", line="plain pyinfra no-op")
systemd.service(name="journald runs", service="systemd-journald.service", running=True)
