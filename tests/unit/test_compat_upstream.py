"""Issue 47 item 4: tools/compat-upstream reads recorded upstream files (tests/fixtures/upstream,
cited in its SOURCES.md) and names every row of compat.yaml that disagrees or is missing: none
on the real recordings but the one compat.yaml explains, each planted disagreement by its row."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from gpufleet.apps import compat_upstream as cu
from gpufleet.catalog.compat import compat_data

pytestmark = pytest.mark.unit
RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "upstream"


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "upstream"
    shutil.copytree(RECORDED, folder)
    return folder


def _plant(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def test_the_recordings_are_read_as_published():
    updates = cu.table3_updates((RECORDED / "cuda-release-notes-table3.md").read_text())
    assert updates["13.2.0"] == "595.45.04" and updates["13.2.2"] == "595.71.05" and updates["11.8.0"] == "520.61.05"
    assert len(updates) == 30
    rows = {(r.version, r.cuda_major): r for r in cu.cudnn_rows((RECORDED / "cudnn-support-matrix.txt").read_text())}
    assert rows[("9.17.0", "12")].compute_capabilities == ("12.0", "10.0", "9.0", "8.9", "8.6", "8.0", "7.5")
    assert rows[("9.17.0", "13")].cuda_versions == ("13.1", "13.0") and rows[("9.17.0", "13")].min_driver == "580.65.06"
    lists = cu.build_arch_lists((RECORDED / "pytorch-build_cuda.sh.excerpt").read_text())
    assert lists == {"12.6": ("5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"),
                     "12.8": ("7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0"),
                     "12.9": ("7.0", "7.5", "8.0", "8.6", "9.0", "10.0", "12.0+PTX"),
                     "13.0": ("7.5", "8.0", "8.6", "9.0", "10.0", "12.0+PTX")}


def test_compat_yaml_agrees_with_the_recordings_but_for_the_row_it_explains():
    findings, read = cu.check(RECORDED)
    assert len(read) == 3
    # 2.11's cu128 list comes from the real wheel (PT4: no sm_70), not the build script: said, with why
    assert [(f.kind, f.row) for f in findings] == [("DISAGREE", "pytorch.releases.2.11.cu128")]
    assert "PT4" in findings[0].note


def test_a_planted_disagreement_is_named_by_its_row(tmp_path, capsys):
    folder = _copy(tmp_path)
    _plant(folder / "cuda-release-notes-table3.md", "| 13.2 Update 2 | >= 595.71.05 |", "| 13.2 Update 2 | >= 595.71.06 |")
    # planted, not published: a release compat.yaml lacks
    _plant(folder / "cuda-release-notes-table3.md", "| 13.2 Update 2 |", "| 13.3 GA | >= 610.43.02 | N/A |\n| 13.2 Update 2 |")
    _plant(folder / "cudnn-support-matrix.txt", "  • 12.0 [3]\n  • 10.0 [3]\n", "")
    _plant(folder / "pytorch-build_cuda.sh.excerpt", '12.8) TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST};10.0;12.0"',
           '12.8) TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST};10.0;12.0;12.1"')
    assert cu.main([str(folder)]) == cu.FOUND
    out = capsys.readouterr().out
    assert ("DISAGREE cuda_releases.13.2.updates.13.2.2: compat.yaml says 595.71.05; cuda-release-notes-table3.md "
            "says 595.71.06") in out
    assert "MISSING cuda_releases.13.3: cuda-release-notes-table3.md says CUDA 13.3.0 needs driver >= 610.43.02" in out
    assert ("DISAGREE cudnn_releases[9.17.0, CUDA 12].compute_capabilities: compat.yaml says 7.5, 8.0, 8.6, 8.9, 9.0, "
            "10.0, 12.0; cudnn-support-matrix.txt says 7.5, 8.0, 8.6, 8.9, 9.0") in out
    assert "DISAGREE pytorch.releases.2.10.cu128:" in out and "DISAGREE pytorch.releases.2.9.cu128:" in out
    assert cu.main([str(folder), "--json"]) == cu.FOUND
    rows = {f["row"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "cuda_releases.13.2.updates.13.2.2" in rows and "cuda_releases.13.3" in rows


def test_the_old_cudnn_row_is_what_the_command_would_have_named():
    """Item 1's cuDNN class, as the command finds it: the 9.17.0 CUDA 12 row without Blackwell."""
    data = compat_data()
    old = dataclasses.replace(data, cudnn_builds=tuple(
        dataclasses.replace(b, compute_capabilities=("7.5", "8.0", "8.6", "8.9", "9.0"))
        if (b.version, b.cuda_major) == ("9.17.0", "12") else b for b in data.cudnn_builds))
    findings, _ = cu.check(RECORDED, data=old)
    assert "cudnn_releases[9.17.0, CUDA 12].compute_capabilities" in {f.row for f in findings}


def test_a_redistrib_manifest(tmp_path):
    # constructed here in the manifests' format (release_label, nvidia_driver.version): not a recording
    folder = tmp_path / "redist"
    folder.mkdir()
    manifest = {"release_label": "13.0.2", "release_product": "cuda",
                "nvidia_driver": {"name": "NVIDIA Linux Driver", "version": "580.95.05"}}
    (folder / "redistrib_13.0.2.json").write_text(json.dumps(manifest))
    assert cu.check(folder)[0] == [] and cu.main([str(folder)]) == 0
    manifest["nvidia_driver"]["version"] = "580.95.04"
    (folder / "redistrib_13.0.2.json").write_text(json.dumps(manifest))
    [finding] = cu.check(folder)[0]
    assert (finding.row, finding.ours, finding.theirs) == ("cuda_releases.13.0.updates.13.0.2", "580.95.05", "580.95.04")


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cu.main([str(tmp_path / "nowhere")])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        cu.main([str(tmp_path)])  # a folder without upstream files
    assert exit_.value.code == 2
