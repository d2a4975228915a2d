"""The stand-in NVIDIA apt repository: package table consistency and the deterministic builder."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from testing import aptrepo
from testing.aptrepo import DRIVERS, Pkg, build_deb, control_text, default_packages

pytestmark = pytest.mark.unit

PKGS = default_packages()
REL = re.compile(r"^(?P<name>[a-z0-9][a-z0-9.+-]*)(?: \((?P<op><<|<=|=|>=|>>) (?P<ver>[^)]+)\))?$")

# Names as documented for NVIDIA's Debian CUDA repo (driver guide, FM packaging, cuDNN/DCGM/CTK
# install guides); see aptrepo.SOURCES. A typo in the table fails here, not on a test host.
DOCUMENTED = {
    "nvidia-open", "cuda-drivers", "cuda-drivers-580", "nvidia-driver", "nvidia-driver-cuda", "libcuda1",
    "libnvidia-ml1", "nvidia-smi", "nvidia-persistenced", "nvidia-kernel-open-dkms", "nvidia-kernel-dkms",
    "nvidia-kernel-support", "nvidia-fabricmanager", "nvidia-driver-pinning-580",
    "nvidia-driver-pinning-580.95.05", "nvidia-driver-pinning-580.126.09",
    "cuda-toolkit-13-0", "cuda-toolkit-12-8", "cuda-nvcc-13-0", "cuda-nvcc-12-8",
    "cuda-compiler-13-0", "cuda-compiler-12-8",
    "cuda-toolkit-config-common", "cuda-toolkit-13-config-common", "cuda-toolkit-12-config-common",
    "cuda-toolkit-13-0-config-common", "cuda-toolkit-12-8-config-common",
    "libcudnn9-cuda-13", "libcudnn9-dev-cuda-13", "libcudnn9-headers-cuda-13",
    "libcudnn9-cuda-12", "libcudnn9-dev-cuda-12", "libcudnn9-headers-cuda-12",
    "datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda12", "datacenter-gpu-manager-4-cuda13",
    "datacenter-gpu-manager-exporter",
    "cuda-nsight-systems-13-0", "cuda-nsight-compute-13-0", "nsight-systems-2025.3.2", "nsight-compute-2025.3.1",
    "cuda-tools-13-0", "cuda-visual-tools-13-0",  # the toolkit reaches Nsight through them (compat.yaml S41)
    "nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
    "libnvidia-container1",
}


def _dpkg_compare(a: str, op: str, b: str) -> bool:
    ops = {"<<": "lt", "<=": "le", "=": "eq", ">=": "ge", ">>": "gt"}
    return subprocess.run(["dpkg", "--compare-versions", a, ops[op], b]).returncode == 0


def _by(name: str, version: str | None = None) -> list[Pkg]:
    return [p for p in PKGS if p.name == name and (version is None or p.version == version)]


def _parse(rel: str) -> tuple[str, str | None, str | None]:
    m = REL.match(rel.strip())
    assert m, f"bad relation {rel!r}"
    return m["name"], m["op"], m["ver"]


def test_names_are_the_documented_real_ones():
    names = {p.name for p in PKGS}
    assert names == DOCUMENTED, (names - DOCUMENTED, DOCUMENTED - names)


def test_toolkit_components_are_versioned_on_their_own_and_asked_for_with_ge():
    """The trap the deploy must close: cuda-toolkit-13-0 13.0.2 asks (through cuda-compiler-13-0)
    for cuda-nvcc-13-0 >= 13.0.88 while the repository offers a newer nvcc (13.0.3's 13.0.96)."""
    (meta,) = _by("cuda-toolkit-13-0", "13.0.2-1")
    assert "cuda-compiler-13-0 (>= 13.0.2)" in meta.depends
    (compiler,) = _by("cuda-compiler-13-0", "13.0.2-1")
    assert compiler.depends == ("cuda-nvcc-13-0 (>= 13.0.88)",)
    assert {p.version for p in _by("cuda-nvcc-13-0")} == {"13.0.88-1", "13.0.96-1"}
    assert {p.version for p in _by("cuda-nvcc-12-8")} == {"12.8.61-1", "12.8.93-1"}


def test_nsight_meta_packages_ask_for_their_release_with_ge_and_a_later_build_exists():
    """The pin has something to prove: 13.0.3's meta asks for later Nsight builds than 13.0.2's."""
    (meta,) = _by("cuda-nsight-compute-13-0", "13.0.2-1")
    assert meta.depends == ("nsight-compute-2025.3.1 (>= 2025.3.1.4)",)
    assert {p.version for p in _by("nsight-systems-2025.3.2")} == {"2025.3.2.474-1", "2025.3.2.999-1"}
    from gpufleet.plans.profiling import nsight_packages
    wanted = nsight_packages("13.0.2")
    assert wanted is not None and set(wanted) <= {p.name for p in PKGS}
    for name, release in wanted.items():
        assert f"{release}-1" in {p.version for p in _by(name)}, name


def test_every_package_version_pair_is_unique_and_well_formed():
    seen = set()
    for p in PKGS:
        assert (p.name, p.version) not in seen, p
        seen.add((p.name, p.version))
        assert re.fullmatch(r"(\d+:)?[0-9][A-Za-z0-9.+~]*-[0-9A-Za-z.+~]+", p.version), p
        assert p.repo in ("cuda", "container") and p.source in aptrepo.SOURCES, p


def test_two_driver_versions_of_one_branch_and_two_cuda_versions():
    assert len(DRIVERS) >= 2
    assert len({d.split(".")[0] for d in DRIVERS}) == 1
    assert {p.version for p in _by("nvidia-open")} == {f"{d}-1" for d in DRIVERS}
    assert _by("cuda-toolkit-13-0") and _by("cuda-toolkit-12-8")
    assert {p.version for p in _by("nvidia-container-toolkit")} == {"1.17.8-1", "1.18.0-1"}


def test_fabric_manager_version_equals_driver_and_depends_on_it_exactly():
    fms = _by("nvidia-fabricmanager")
    assert {p.version for p in fms} == {f"{d}-1" for d in DRIVERS}
    for fm in fms:
        exact = [_parse(r) for r in fm.depends if _parse(r)[1] == "="]
        assert ("nvidia-driver-cuda", "=", fm.version) in exact, fm.depends
        # R580+: the old branch name is an (unversioned) virtual package of the unversioned one
        branch = fm.version.split(".")[0]
        assert f"nvidia-fabricmanager-{branch}" in fm.provides


def test_every_dependency_is_resolvable_inside_the_repo():
    for repo in ("cuda", "container"):
        pool = [p for p in PKGS if p.repo == repo]
        for p in pool:
            for rel in p.depends:
                alternatives = [_parse(a) for a in rel.split("|")]
                ok = False
                for name, op, ver in alternatives:
                    real = [q for q in pool if q.name == name and (op is None or _dpkg_compare(q.version, op, ver))]
                    virtual = [q for q in pool for prov in q.provides if _parse(prov)[0] == name and op is None]
                    ok = ok or bool(real or virtual)
                assert ok, f"{p.name} {p.version}: {rel!r} has no match in the {repo} repo"


def test_driver_packages_of_a_release_share_its_version():
    for d in DRIVERS:
        v = f"{d}-1"
        for name in ("nvidia-driver", "nvidia-driver-cuda", "libcuda1", "nvidia-persistenced",
                     "nvidia-kernel-open-dkms", "nvidia-fabricmanager", f"nvidia-driver-pinning-{d}"):
            assert _by(name, v), (name, v)


def test_pinning_packages_pin_the_driver_and_fabric_manager():
    for d in DRIVERS:
        (pin,) = _by(f"nvidia-driver-pinning-{d}")
        (path, text, _), = pin.files
        assert path.startswith("/etc/apt/preferences.d/")
        assert f"Pin: version {d}-*" in text and "Pin-Priority: 1000" in text
        pinned = text.split("Package:", 1)[1].splitlines()[0].split()
        assert {"nvidia-open", "nvidia-driver-cuda", "nvidia-fabricmanager"} <= set(pinned)


def test_checked_files_are_installed_by_their_packages():
    files = {path: p.name for p in PKGS for path, _, _ in p.files}
    assert files["/usr/local/cuda-13.0/bin/nvcc"] == "cuda-nvcc-13-0"
    assert files["/usr/local/cuda-12.8/bin/nvcc"] == "cuda-nvcc-12-8"
    assert files["/usr/bin/nv-fabricmanager"] == "nvidia-fabricmanager"
    assert files["/lib/systemd/system/nvidia-fabricmanager.service"] == "nvidia-fabricmanager"
    assert files["/usr/bin/nvidia-persistenced"] == "nvidia-persistenced"
    assert files["/lib/systemd/system/nvidia-persistenced.service"] == "nvidia-persistenced"
    assert files["/usr/bin/nvidia-ctk"] == "nvidia-container-toolkit-base"
    # every stand-in script and unit says what it is
    for p in PKGS:
        for _, content, _ in p.files:
            assert aptrepo.STAND_IN_NOTE in content


def test_control_text_carries_relations_and_the_stand_in_note():
    (fm,) = _by("nvidia-fabricmanager", "580.95.05-1")
    text = control_text(fm)
    assert "Package: nvidia-fabricmanager\nVersion: 580.95.05-1\n" in text
    assert "Depends: nvidia-driver-cuda (= 580.95.05-1)" in text
    assert "Provides: nvidia-fabricmanager-580\n" in text
    assert aptrepo.STAND_IN_NOTE in text


@pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="needs dpkg-deb")
def test_builder_is_deterministic_and_cached(tmp_path):
    (fm,) = _by("nvidia-fabricmanager", "580.95.05-1")
    a = build_deb(fm, cache=tmp_path / "a")
    b = build_deb(fm, cache=tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    mtime = a.stat().st_mtime_ns
    assert build_deb(fm, cache=tmp_path / "a") == a and a.stat().st_mtime_ns == mtime  # cache hit
    info = subprocess.run(["dpkg-deb", "--field", str(a)], capture_output=True, text=True, check=True).stdout
    assert "Version: 580.95.05-1" in info
    listing = subprocess.run(["dpkg-deb", "--contents", str(a)], capture_output=True, text=True, check=True).stdout
    assert "./usr/share/doc/nvidia-fabricmanager/STAND-IN" in listing
    assert "./usr/bin/nv-fabricmanager" in listing and "root/root" in listing
    other = build_deb(_by("nvidia-fabricmanager", "580.126.09-1")[0], cache=tmp_path / "a")
    assert other.parent != a.parent


def test_epoch_is_not_part_of_the_file_name():
    (dcgm,) = _by("datacenter-gpu-manager-4-core")
    assert dcgm.version.startswith("1:") and dcgm.filename == "datacenter-gpu-manager-4-core_4.4.0-1_amd64.deb"


def test_base_url_shape_matches_production():
    repo = aptrepo.AptRepo(url="", keyring=None, key_armored="", root=None, port=4321)
    assert repo.base_url("debian12") == "http://127.0.0.1:4321/compute/cuda/repos/debian12/x86_64/"
    assert repo.cuda_repos_url + "/debian13/x86_64/" == repo.base_url("debian13")
    assert repo.sources_line("debian12") == (
        "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
        "http://127.0.0.1:4321/compute/cuda/repos/debian12/x86_64/ /")
    with pytest.raises(ValueError):
        repo.base_url("debian11")
