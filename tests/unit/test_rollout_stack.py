"""tools/rollout moves the CUDA toolkit and cuDNN too (issue 17): which packages move, to which
Debian versions, what the validation step checks, and the state's per-host stack target."""
from types import SimpleNamespace

import pytest

from gpufleet.rollout.manifest import stack_changes, stack_moves, validation_problems
from gpufleet.rollout.moves import MoveRefusal, RolloutMove, rollout_move
from gpufleet.rollout.state import RolloutState

pytestmark = pytest.mark.unit

WANTED = {"cuda-toolkit-12-8": "12.8.1", "libcudnn9-cuda-12": "9.17.0.29", "libcudnn9-dev-cuda-12": "9.17.0.29"}
INSTALLED = {"cuda-toolkit-12-8": "12.8.1-1", "libcudnn9-cuda-12": "9.10.2.21-1", "libcudnn9-dev-cuda-12": "9.10.2.21-1",
             "nvidia-open": "580.126.09-1"}


def test_only_installed_packages_at_another_release_move():
    assert stack_moves(INSTALLED, WANTED) == {"libcudnn9-cuda-12": ("9.10.2.21", "9.17.0.29"),
                                              "libcudnn9-dev-cuda-12": ("9.10.2.21", "9.17.0.29")}
    assert stack_moves({**INSTALLED, "libcudnn9-dev-cuda-12": None}, WANTED) == {
        "libcudnn9-cuda-12": ("9.10.2.21", "9.17.0.29")}          # not installed: left to all.py
    assert stack_moves(INSTALLED, {}) == {}


def test_the_exact_release_is_chosen_among_older_and_newer():
    offered = ["9.17.1.4-1", "9.17.0.29-1", "9.10.2.21-1"]
    available = {"libcudnn9-cuda-12": offered, "libcudnn9-dev-cuda-12": ["9.17.1.4-1"]}
    refused = rollout_move(INSTALLED, [], available, "580.126.09", WANTED, {}, {}, True)
    assert isinstance(refused, MoveRefusal) and refused.area == "cuda_version"
    assert refused.reason == "the configured repositories offer no libcudnn9-dev-cuda-12 9.17.0.29: CUDA toolkit / cuDNN not moved"
    available["libcudnn9-dev-cuda-12"] = offered
    move = rollout_move(INSTALLED, [], available, "580.126.09", WANTED, {}, {}, True)
    assert isinstance(move, RolloutMove) and move.remove == ()
    assert move.install == {"libcudnn9-cuda-12": "9.17.0.29-1", "libcudnn9-dev-cuda-12": "9.17.0.29-1"}
    assert set(move.install) <= set(move.hold)   # driver_hold: what moves is held


def test_a_new_package_name_replaces_the_old_one_in_one_transaction():
    # the inventory went from CUDA 13.0 / cuDNN for CUDA 13 to CUDA 12.8 / cuDNN for CUDA 12
    on_13 = {"cuda-toolkit-13-0": "13.0.2-1", "libcudnn9-cuda-13": "9.17.0.29-1",
             "libcudnn9-dev-cuda-13": "9.17.0.29-1", "cuda-nvcc-13-0": "13.0.88-1", "nvidia-open": "580.126.09-1"}
    offered = {"cuda-toolkit-12-8": ["12.8.1-1", "12.8.0-1"], "libcudnn9-cuda-12": ["9.17.0.29-1", "9.10.2.21-1"],
               "libcudnn9-dev-cuda-12": ["9.17.0.29-1"]}
    assert stack_moves(on_13, WANTED) == {}
    assert stack_changes(on_13, WANTED) == [
        "cuda-toolkit-13-0 13.0.2 -> cuda-toolkit-12-8 12.8.1 (replaces cuda-toolkit-13-0)",
        "libcudnn9-cuda-13 9.17.0.29 -> libcudnn9-cuda-12 9.17.0.29 (replaces libcudnn9-cuda-13, libcudnn9-dev-cuda-13)"]
    move = rollout_move(on_13, ["cuda-toolkit-13-0", "nvidia-open"], offered, "580.126.09", WANTED,
                        {"cuda-toolkit-12-8": {"cuda-toolkit-12-8": {"12.8.1-1": ""}}}, {}, False)
    assert isinstance(move, RolloutMove), move
    assert move.install == {"cuda-toolkit-12-8": "12.8.1-1", "libcudnn9-cuda-12": "9.17.0.29-1",
                            "libcudnn9-dev-cuda-12": "9.17.0.29-1"}
    assert move.remove == ("cuda-toolkit-13-0", "libcudnn9-cuda-13", "libcudnn9-dev-cuda-13")
    assert move.hold == ("nvidia-open",)  # the replaced toolkit's hold goes with it
    driver = SimpleNamespace(module_version="580.126.09", userspace_version="580.126.09")
    gpus = SimpleNamespace(ok=True, driver_version="580.126.09", gpus=[])
    assert validation_problems("580.126.09", driver, gpus, [], None, WANTED, on_13) == [
        "cuda-toolkit-12-8 12.8.1 is not installed; cuda-toolkit-13-0 13.0.2 still is",
        "libcudnn9-cuda-12 9.17.0.29 is not installed; libcudnn9-cuda-13 9.17.0.29 still is"]


def test_validation_checks_the_releases_and_their_holds():
    driver = SimpleNamespace(module_version="580.126.09", userspace_version="580.126.09")
    gpus = SimpleNamespace(ok=True, driver_version="580.126.09", gpus=[])
    exact = {**INSTALLED, "libcudnn9-cuda-12": "9.17.0.29-1", "libcudnn9-dev-cuda-12": "9.17.0.29-1"}
    held = ["libcudnn9-cuda-12", "libcudnn9-dev-cuda-12"]   # what moved; the toolkit was not held before
    manifest = {"packages": INSTALLED, "holds": [], "gpus": []}
    assert validation_problems("580.126.09", driver, gpus, held, manifest, WANTED, exact, True) == []
    assert validation_problems("580.126.09", driver, gpus, held, manifest, WANTED, INSTALLED, True) == [
        "libcudnn9-cuda-12 is 9.10.2.21, not 9.17.0.29", "libcudnn9-dev-cuda-12 is 9.10.2.21, not 9.17.0.29"]
    assert validation_problems("580.126.09", driver, gpus, held[:1], manifest, WANTED, exact, True) == [
        "not held after the upgrade: libcudnn9-dev-cuda-12"]


def test_a_done_host_is_rolled_out_again_when_its_stack_target_moves(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "inventory", "inv.py")
    old, new = {"libcudnn9-cuda-12": "9.10.2.21"}, {"libcudnn9-cuda-12": "9.17.0.29"}
    assert st.retarget("h1", "580.126.09", old) is None
    st.mark("h1", "done")
    assert st.retarget("h1", "580.126.09", old) is None and st.host("h1").status == "done"
    assert st.retarget("h1", "580.126.09", new) is None and st.host("h1").status == "pending"
    assert st.host("h1").stack == new
    st.finish("h1", "upgrade", True)
    why = st.retarget("h1", "580.126.09", old)
    assert "half-way through a rollout to CUDA/cuDNN libcudnn9-cuda-12 9.17.0.29" in why
    st.save()
    assert RolloutState.load(tmp_path / "s.json", "inventory", "inv.py").host("h1").stack == new


def test_validation_leaves_the_clocks_of_gpus_in_mig_mode_alone():
    """Clocks are not settable in MIG mode (and a mode change resets them): not compared there."""
    driver = SimpleNamespace(module_version="580.126.09", userspace_version="580.126.09")
    gpu = SimpleNamespace(uuid="GPU-a", index=0, persistence=True, app_clocks=(3201, 1785))
    gpus = SimpleNamespace(ok=True, driver_version="580.126.09", gpus=[gpu])
    manifest = {"packages": {}, "holds": [], "gpus": [{"uuid": "GPU-a", "index": 0, "persistence": True,
                                                       "app_clocks": [3201, 1980]}]}
    assert validation_problems("580.126.09", driver, gpus, [], manifest) == [
        "GPU 0: application clocks [3201, 1785], were [3201, 1980]"]
    assert validation_problems("580.126.09", driver, gpus, [], manifest, mig_on=frozenset({"GPU-a"})) == []
