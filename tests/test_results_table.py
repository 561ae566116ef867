"""The front page's results table is generated from ``bench/results/*.json`` and cannot drift
from them (bench/results.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._bench import load_bench

results = load_bench("results")


def test_the_readme_table_is_the_records_table() -> None:
    text = results.README.read_text()
    assert results.render_readme(text) == text, (
        "README.md's results table differs from bench/results/: run "
        "`python bench/results.py table --write`")


def test_every_record_names_its_commit_date_and_command() -> None:
    records = sorted(results.RESULTS.glob("*.json"))
    assert records, "no records in bench/results/"
    for path in records:
        rec = json.loads(path.read_text())
        assert rec["name"] == path.stem
        assert rec["commit"] and rec["date"] and rec["command"], path
        assert isinstance(rec["data"], dict), path
    named = {row.record for row in results.ROWS}
    assert {p.stem for p in records} <= named, "a record no row of the table shows"


def test_a_stale_table_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{results.BEGIN}\n| old | table |\n{results.END}\ny\n")
    monkeypatch.setattr(results, "README", readme)
    assert results.main(["table", "--check"]) == 1
    assert results.main(["table", "--write"]) == 0
    assert results.main(["table", "--check"]) == 0
    assert "| old | table |" not in readme.read_text()


def test_a_command_result_is_recorded_with_its_last_json_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert results.main(["record", "demo", "--", "python3", "-c",
                         "print('a table'); print('{\"x\": 1}'); print('{\"x\": 2}')"]) == 0
    rec: dict[str, Any] = json.loads((tmp_path / "demo.json").read_text())
    assert rec["data"] == {"x": 2} and rec["command"].startswith("python3 -c")
    with pytest.raises(ValueError, match="no JSON line"):
        results.last_json_line("no json here\n")
