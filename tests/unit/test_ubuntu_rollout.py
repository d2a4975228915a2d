"""tools/rollout and tools/rollback on Ubuntu's own driver with prebuilt modules (`driver_source:
distro`, linux-modules-nvidia-580-server[-open]-*), planned by pyinfra on a simulated Ubuntu
22.04 host (testing/ubuntu_host.py, provisioned=True: tests/fixtures/ubuntu/22.04/provisioned/,
composed, see SOURCES.md) and on the pure plan in gpufleet/rollout/manifest.py.

The promise: the prebuilt module packages move with the driver in the same unhold / install
exact / re-hold unit (gpufleet-package-change), the kernel flavour metapackages they follow are
released and held again by that unit only, and rollback puts the recorded versions back."""
from __future__ import annotations

import shlex

import pytest

from gpufleet.rollout.moves import RolloutMove, rollout_move

from gpufleet.rollout import manifest as mf
from gpufleet.rollout import targets
from gpufleet.rollout.context import RolloutContext
from testing.ubuntu_host import UbuntuHost, canned, make_state, on_host, planned_operations

OLD, NEW = "580.95.05-0ubuntu0.22.04.2", "580.173.02-0ubuntu0.22.04.1"
ABI = "linux-modules-nvidia-580-server-open-6.8.0-90-generic"
MODULES_META = "linux-modules-nvidia-580-server-open-generic-hwe-22.04"
KERNEL_METAS = ["linux-generic-hwe-22.04", "linux-image-generic-hwe-22.04", "linux-headers-generic-hwe-22.04"]
DRIVER = ["libnvidia-cfg1-580-server", "libnvidia-compute-580-server", "nvidia-compute-utils-580-server",
          "nvidia-headless-no-dkms-580-server-open", "nvidia-kernel-common-580-server", "nvidia-utils-580-server"]


def run_step(step, ctx: RolloutContext) -> tuple[list[tuple[str, list[str]]], RolloutContext]:
    host = UbuntuHost("22.04", ["Tesla T4"], provisioned=True)
    name = "gpu-ubuntu-2204"
    state = make_state({name: (host, {"tier": "dev", "validate_os_release": "ubuntu-22.04"})})
    with canned({name: host}), on_host(state, name) as h:
        step(ctx)
        return planned_operations(state, h), ctx


def change_arguments(ops) -> list[str]:
    """The words given to the fixed package-change script (after its name)."""
    [command] = [c for _, commands in ops for c in commands if "gpufleet-package-change" in c and "systemd-run" in c]
    words = shlex.split(command)
    return words[words.index("gpufleet-package-change") + 1:]


def test_rollout_moves_driver_and_prebuilt_modules_in_one_unit_and_holds_the_kernels_again():
    from gpufleet.deploys.upgrade import upgrade

    ops, ctx = run_step(upgrade, RolloutContext(target="580.173.02"))
    assert not ctx.reasons, ctx.reasons
    args = change_arguments(ops)
    installs = {a.split("=", 1)[1].split("=")[0]: a.split("=", 2)[2] for a in args if a.startswith("install=")}
    # the driver at the exact SRU, the prebuilt modules at the build of it the archive offers
    assert installs == {**{p: NEW for p in DRIVER}, ABI: "6.8.0-90.91~22.04.1+1", MODULES_META: "6.8.0-90.91~22.04.1+1"}
    unhold = {a[len("unhold="):] for a in args if a.startswith("unhold=")}
    hold = {a[len("hold="):] for a in args if a.startswith("hold=")}
    # released only inside the unit, held again by it whatever apt does: kernels and modules together
    for package in (ABI, MODULES_META, *KERNEL_METAS, "nvidia-headless-no-dkms-580-server-open", "nvidia-utils-580-server"):
        assert package in unhold and package in hold, package
    assert [name for name, _ in ops if "Move" in name] == [
        "Upgrade the driver | Move driver to 580.173.02, prebuilt modules"]


def test_the_manifest_records_the_modules_and_the_kernel_metapackages_and_rollback_puts_them_back():
    from gpufleet.operations import manifest_steps as steps
    from gpufleet.deploys.rollback import restore

    host = UbuntuHost("22.04", ["Tesla T4"], provisioned=True)
    name = "gpu-ubuntu-2204"
    state = make_state({name: (host, {"tier": "dev", "validate_os_release": "ubuntu-22.04"})})
    with canned({name: host}), on_host(state, name):
        installed = steps.installed_packages()
    # what the snapshot step records (manifest patterns + the kernel metapackages of the modules' flavour)
    assert {ABI: "6.8.0-90.91~22.04.1", MODULES_META: "6.8.0-90.91~22.04.1"}.items() <= installed.items()
    assert all(installed[k] == "6.8.0-90.91~22.04.1" for k in KERNEL_METAS)
    # a manifest from before a rollout to a later build: rollback puts the recorded versions back
    recorded = {**installed, ABI: "6.8.0-90.91~22.04.1~old", MODULES_META: "6.8.0-90.91~22.04.1~old",
                "linux-image-generic-hwe-22.04": "6.8.0-88.89~22.04.1", "nvidia-utils-580-server": "580.82.07-0ubuntu0.22.04.1"}
    doc = mf.build(host=name, ident="20261201T120000Z", created=0.0, reason="test", packages=recorded,
                   holds=[ABI, MODULES_META, *KERNEL_METAS, "nvidia-utils-580-server"], etc_files={},
                   driver={}, gpus=[], disk_snapshot=None)
    ctx = RolloutContext(target="580.82.07", manifests={name: doc})
    ops, _ = run_step(restore, ctx)
    args = change_arguments(ops)
    assert f"install={ABI}=6.8.0-90.91~22.04.1~old" in args
    assert f"install={MODULES_META}=6.8.0-90.91~22.04.1~old" in args
    assert "install=linux-image-generic-hwe-22.04=6.8.0-88.89~22.04.1" in args
    assert "install=nvidia-utils-580-server=580.82.07-0ubuntu0.22.04.1" in args
    assert "downgrade" in args
    assert {f"hold={p}" for p in (ABI, MODULES_META, *KERNEL_METAS)} <= set(args)
    # the idle check in the very command that starts the change, as the rollout's (--force: none)
    [change] = [c for _, commands in ops for c in commands if "gpufleet-package-change" in c]
    assert "GPU work is running, not changing the driver packages" in change
    forced, _ = run_step(restore, RolloutContext(target="580.82.07", manifests={name: doc}, force=True))
    [change] = [c for _, commands in forced for c in commands if "gpufleet-package-change" in c]
    assert "GPU work is running" not in change


def test_prebuilt_plan_moves_kernels_with_their_modules_or_refuses():
    installed = {ABI: "6.8.0-90.91~22.04.1", MODULES_META: "6.8.0-90.91~22.04.1",
                 "linux-modules-nvidia-580-server-open-6.8.0-85-generic": "6.8.0-85.85~22.04.1",
                 **{k: "6.8.0-90.91~22.04.1" for k in KERNEL_METAS}, "nvidia-utils-580-server": OLD}
    assert mf.kernel_metapackages(installed) == KERNEL_METAS
    # a new kernel with the new build (synthetic versions): the metapackages all move, together
    offered = {ABI: ["6.8.0-90.91~22.04.1+1"], MODULES_META: ["6.8.0-94.96~22.04.1+1"],
               **{k: ["6.8.0-94.96~22.04.1"] for k in KERNEL_METAS}}
    install, missing = mf.prebuilt_plan(installed, offered)
    assert missing == []  # the 6.8.0-85 build the archive dropped is left as it is
    assert install == {ABI: "6.8.0-90.91~22.04.1+1", MODULES_META: "6.8.0-94.96~22.04.1+1",
                       **{k: "6.8.0-94.96~22.04.1" for k in KERNEL_METAS}}
    # a flavour metapackage the sources do not offer: the host is refused (nothing moves alone)
    _, missing = mf.prebuilt_plan(installed, {k: v for k, v in offered.items() if k != "linux-image-generic-hwe-22.04"})
    assert missing == ["linux-image-generic-hwe-22.04"]
    # at the offered versions already: nothing
    assert mf.prebuilt_plan({ABI: "1", MODULES_META: "1"}, {ABI: ["1"], MODULES_META: ["1"]}) == ({}, [])
    # DKMS hosts and NVIDIA's repository: no prebuilt modules, nothing here
    assert mf.prebuilt_plan({"nvidia-dkms-580-server-open": OLD}, {}) == ({}, [])


@pytest.mark.parametrize("name", DRIVER + ["nvidia-dkms-580-server-open", "nvidia-driver-580-server",
                                           "nvidia-kernel-source-580-server-open", "nvidia-headless-580-server"])
def test_ubuntu_series_packages_move_with_the_driver_version(name):
    assert mf.DRIVER_PACKAGE.match(name) and not mf.NOT_DRIVER.match(name)
    move = rollout_move({name: OLD}, [], {name: [NEW]}, "580.173.02", {}, {}, {}, True)
    assert isinstance(move, RolloutMove) and move.install == {name: NEW}


def test_rollout_takes_ubuntus_own_driver_not_debians():
    assert targets.rollable_source("distro", "ubuntu-22.04") and targets.rollable_source("distro", "ubuntu-24.04")
    assert targets.rollable_source("nvidia", "debian-12")
    assert not targets.rollable_source("distro", "debian-12")
    assert targets.rollable({"driver_source": "distro", "os": "ubuntu-24.04"})
    assert not targets.rollable({"driver_source": "distro", "os": "debian-13"})


def test_retune_applies_the_tiers_tuning_and_the_default_restores_the_record(monkeypatch):
    """`tools/rollout --retune`: the runner's tune step applies the tier's tuning (deploys/tuning.py,
    as all.py does) instead of the manifest's record; the CDI spec follows either way."""
    import gpufleet.deploys.docker as docker_deploy
    import gpufleet.deploys.tuning as tuning_deploy
    import gpufleet.deploys.upgrade as steps
    from gpufleet.apps.rollout.runner import tune_and_cdi

    ran: list[str] = []
    monkeypatch.setattr(tuning_deploy, "tuning", lambda: ran.append("tuning"))
    monkeypatch.setattr(steps, "tune", lambda ctx: ran.append("restore the record"))
    monkeypatch.setattr(docker_deploy, "cdi_after_driver_change", lambda: ran.append("cdi"))
    tune_and_cdi(RolloutContext(target="580.173.02", retune=True))
    assert ran == ["tuning", "cdi"]
    ran.clear()
    tune_and_cdi(RolloutContext(target="580.173.02"))
    assert ran == ["restore the record", "cdi"]
