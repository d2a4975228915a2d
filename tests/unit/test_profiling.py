"""tuning_profiling's plan (gpufleet/plans/profiling.py) from the ProfilingState fact's recorded shapes
(tests/unit/facts/kernel.ProfilingState) and the resolved CUDA toolkit: the modprobe.d file, what
the next module load gives, pending until then, other files' options, the Nsight packages."""
from __future__ import annotations

import pytest

from gpufleet.facts.kernel import ProfilingStateData
from gpufleet.config.failures import Refused
from gpufleet.plans.profiling import FILE_TEXT, MODPROBE_FILE, plan_profiling

pytestmark = pytest.mark.unit

OURS = {MODPROBE_FILE: 0}
NSIGHT = {"cuda-nsight-systems-13-0": "13.0.2", "nsight-systems-2025.3.2": "2025.3.2.474",
          "cuda-nsight-compute-13-0": "13.0.2", "nsight-compute-2025.3.1": "2025.3.1.4"}


def state(admin_only: int | None, options: dict[str, int] | None = None) -> ProfilingStateData:
    return ProfilingStateData(loaded=admin_only is not None, admin_only=admin_only, options=options or {})


def test_users_on_a_host_at_the_drivers_default_is_pending_until_the_module_is_loaded_again():
    plan = plan_profiling("users", state(1), "13.0.2", True)
    assert plan.file_text == FILE_TEXT and "options nvidia NVreg_RestrictProfilingToAdminUsers=0\n" in FILE_TEXT
    assert (plan.wanted, plan.loaded, plan.pending) == (0, 1, True)
    assert plan.nsight == NSIGHT
    assert "PENDING until a reboot (tools/rollout)" in plan.summary()


def test_users_after_the_reboot_is_as_recorded_on_the_h200_and_not_pending():
    plan = plan_profiling("users", state(0, OURS), "13.0.2", True)
    assert not plan.pending and "every user" in plan.summary()


def test_admins_removes_gpufleets_file_and_a_module_loaded_with_it_waits_for_the_reboot():
    plan = plan_profiling("admins", state(0, OURS), "13.0.2", True)
    assert plan.file_text is None and plan.nsight == {}
    assert (plan.wanted, plan.pending) == (1, True)


def test_admins_leaves_another_files_option_alone_and_the_next_load_follows_it():
    other = {"/etc/modprobe.d/nvprofiling.conf": 0}
    plan = plan_profiling("admins", state(0, {**other, **OURS}), None, False)
    assert plan.others == other and plan.wanted == 0 and not plan.pending


def test_a_reboot_helps_only_once_the_file_says_it_what_tools_rollout_reboots_for():
    assert not plan_profiling("users", state(1), "13.0.2", True).reboot_helps      # all.py has not written it
    assert plan_profiling("users", state(1, OURS), "13.0.2", True).reboot_helps
    assert plan_profiling("admins", state(0), None, False).reboot_helps             # gone: the default again
    assert not plan_profiling("admins", state(0, OURS), None, False).reboot_helps   # all.py removes it first


def test_users_refuses_another_file_that_restricts_naming_it():
    with pytest.raises(Refused) as refused:
        plan_profiling("users", state(1, {"/usr/lib/modprobe.d/site.conf": 1}), "13.0.2", True)
    assert str(refused.value).startswith("key 'tuning_profiling': /usr/lib/modprobe.d/site.conf sets "
                                         "NVreg_RestrictProfilingToAdminUsers=1 (not gpufleet's file)")
    assert refused.value.allowed == "admins, or remove that line from /usr/lib/modprobe.d/site.conf"


def test_no_module_loaded_is_not_pending_the_option_counts_at_the_first_load():
    plan = plan_profiling("users", state(None), "13.0.2", True)
    assert plan.loaded is None and not plan.pending


def test_without_a_host_toolkit_from_nvidia_no_nsight_and_it_says_why():
    plan = plan_profiling("users", state(1), None, False)
    assert plan.nsight == {} and plan.note.startswith("no Nsight tools: no host CUDA toolkit")


def test_a_toolkit_release_without_nsight_data_is_refused_naming_the_releases_that_have_it():
    with pytest.raises(Refused) as refused:
        plan_profiling("users", state(1), "12.8.1", True)
    assert "no Nsight Systems / Nsight Compute release is recorded for CUDA 12.8.1" in refused.value.problem
    assert refused.value.allowed == "admins, or a cuda_version whose release has them: 13.0.2"


def test_an_unknown_value_is_refused():
    with pytest.raises(Refused):
        plan_profiling("everyone", state(1), None, False)
