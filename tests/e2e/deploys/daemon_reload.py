"""Test runner: one unit drop-in written, then gpufleet's gated daemon-reload for it (what
tuning, monitoring and hardening do when their units change)."""
from io import StringIO

from pyinfra.operations import files

from gpufleet.operations.daemon_reload import reload_when

files.directory(name="The test unit's drop-in folder", path="/etc/systemd/system/gf-test.service.d", mode="755")
dropin = files.put(name="A drop-in for the test unit", src=StringIO("[Service]\nEnvironment=GF_TEST=1\n"),
                   dest="/etc/systemd/system/gf-test.service.d/gpufleet-test.conf", mode="644")
reload_when("Let systemd read the test unit's drop-in", dropin)
