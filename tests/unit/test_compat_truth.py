"""Issue 47: `tools/compat --json` answers every case of tests/unit/compat_truth/cases.yaml as the
published source named in the case says (tests as data: a case is a row, with its source)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet import yamlload
from gpufleet.apps import compat

pytestmark = pytest.mark.unit

CASES = yamlload.safe_load((Path(__file__).parent / "compat_truth" / "cases.yaml").read_text(encoding="utf-8"))["cases"]


def _argv(args: dict[str, Any]) -> list[str]:
    argv = ["--json"]
    for flag, value in args.items():
        for one in value if isinstance(value, list) else [value]:
            argv += [f"--{flag}", str(one)]
    return argv


def _at(answer: Any, path: str) -> Any:
    for part in path.split("."):
        answer = answer[part] if isinstance(answer, dict) else None
    return answer


def test_every_case_names_its_source():
    ids = [case["id"] for case in CASES]
    assert len(ids) == len(set(ids))
    assert all(case.get("source") for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_compat_json_answers_as_the_source_says(case: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    code = compat.main(_argv(case["args"]))
    answer = json.loads(capsys.readouterr().out)
    refused = "refused_key" in case["expect"]
    assert code == (compat.REFUSED if refused else 0), answer
    for path, want in case["expect"].items():
        assert _at(answer, path) == want, (path, answer)
    for value in case.get("allowed_has", []):
        assert value in answer["allowed"], answer
    for value in case.get("allowed_lacks", []):
        assert value not in answer["allowed"], answer
    for text in case.get("notes_has", []):
        assert any(text in note for note in answer["notes"]), answer["notes"]
    for text in case.get("notes_lack", []):
        assert not any(text in note for note in answer["notes"]), answer["notes"]


def test_a_gpu_newer_than_the_branch_default_takes_a_newer_release_of_the_branch():
    """The class of item 1, on any constraint: a branch whose default is older than what a GPU
    needs is not refused while a known release of it fits (here R580 with its default moved back
    to 580.65.06: B300 needs 580.82.07, S11/S15)."""
    import dataclasses

    from gpufleet.catalog.compat import compat_data
    from gpufleet.config.resolver import resolve

    data = compat_data()
    older = dataclasses.replace(data.driver_branches["580"], default="580.65.06")
    variant = dataclasses.replace(data, driver_branches={**data.driver_branches, "580": older})
    res = resolve(["NVIDIA B300 SXM6 AC"], {"driver_branch": "580"}, "ubuntu-24.04", data=variant)
    assert res.driver_version == "580.82.07"
    # with no update asked, the GA driver keeps the default and CUDA 13.0 is its GA update
    res = resolve(["NVIDIA H100 80GB HBM3"], {"driver_branch": "580", "cuda_version": "13.0"}, "ubuntu-24.04",
                  data=variant)
    assert (res.driver_version, res.cuda_release) == ("580.65.06", "13.0.0")


LIST_GPUS = yamlload.safe_load((Path(__file__).parent / "compat_truth" / "cases.yaml").read_text(encoding="utf-8"))["list_gpus"]


def test_list_gpus_names_the_newest_stack_of_each_gpu(capsys: pytest.CaptureFixture[str]):
    assert compat.main(["--list-gpus", "--json"]) == 0
    rows = {row["gpu"]: row for row in json.loads(capsys.readouterr().out)}
    for want in LIST_GPUS:
        row = rows[want["gpu"]]
        for key, value in want.items():
            if key != "source":
                assert row[key] == value, (want["gpu"], key, row)
    assert compat.main(["--list-gpus"]) == 0  # the table: a header and one line per GPU
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t")[:3] == ["gpu", "arch", "cc"] and len(lines) == len(rows) + 1
    assert any(line.startswith("Tesla P40\tpascal\t6.1\t") and "R580 (580.173.02), last R580\tno\t12.9" in line
               for line in lines)


def test_the_cases_cover_every_gpu_generation_of_the_catalogue():
    from gpufleet.catalog.gpus import catalog, model_for_name

    asked = {model_for_name(g).arch for case in CASES for g in case["args"]["gpu"]}  # type: ignore[union-attr]
    assert {m.arch for m in catalog()} <= asked
    classes = {model_for_name(g).gpu_class for case in CASES for g in case["args"]["gpu"]}  # type: ignore[union-attr]
    assert classes == {"datacenter", "workstation", "geforce"}
