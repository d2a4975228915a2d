"""gpufleet/controller/staging.py: what the staging script's answer lets through (the transfers themselves
are proven on a real host, tests/e2e/test_hostlock_attack.py)."""
from __future__ import annotations

import pytest

from gpufleet.controller import staging


@pytest.mark.parametrize("lines,folder", [
    (["STAGE /var/lib/gpufleet-upload.1000"], "/var/lib/gpufleet-upload.1000"),
    (["", "STAGE /var/lib/gpufleet-upload.0  "], "/var/lib/gpufleet-upload.0"),
])
def test_the_folder_the_script_names_is_used(lines, folder):
    assert staging.parse_stage(lines) == folder


@pytest.mark.parametrize("lines,said", [
    (["UNSAFE directory, owner student, mode 755"], "(directory, owner student, mode 755)"),
    (["UNSAFE symbolic link, owner root, mode 777"], "(symbolic link, owner root, mode 777)"),
    (["NOUID sudo did not say who logged in (SUDO_UID)"], "(sudo did not say who logged in (SUDO_UID))"),
    ([], "(no answer)"),
    # a folder elsewhere, or a name with more after it, is never taken from the answer
    (["STAGE /tmp/pyinfra-stage"], "(STAGE /tmp/pyinfra-stage)"),
    (["STAGE /var/lib/gpufleet-upload.1000/../../../tmp"], "(STAGE /var/lib/gpufleet-upload.1000/../../../tmp)"),
    (["STAGE /var/lib/gpufleet-upload.1000\x1b[2J"], "STAGE /var/lib/gpufleet-upload.1000"),
])
def test_anything_else_is_refused_naming_the_folder(lines, said):
    with pytest.raises(staging.StagingRefused) as refused:
        staging.parse_stage(lines)
    text = str(refused.value)
    assert text.startswith("refused the gpufleet staging folder /var/lib/gpufleet-upload.<uid>: not the login "
                           "user's own 0700 folder in root's /var/lib")
    assert said in text and "\x1b" not in text


def test_every_transfer_gets_a_name_of_its_own():
    names = {staging.temp_name("/var/lib/gpufleet-upload.1000") for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("/var/lib/gpufleet-upload.1000/") for n in names)
