"""The generated configuration reference (pdscope/configdoc.py, docs/configuration.md)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from pdscope import configdoc
from pdscope.config import Settings
from pdscope.simconfig import SimulatorConfig


def test_docs_configuration_md_is_current() -> None:
    on_disk = configdoc.DOC_PATH.read_text(encoding="utf-8")
    assert on_disk == configdoc.render(), f"docs/configuration.md is stale: run {configdoc.COMMAND}"


def _keys(model: type[BaseModel], prefix: str) -> set[str]:
    out: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        out.add(key)
        nested = configdoc._model_in(field.annotation)
        if nested is not None:
            out |= _keys(nested[0], key + nested[1])
    return out


def test_every_field_has_a_row_with_its_own_description() -> None:
    rows = {r.key: r for s in configdoc.sections() for r in s.rows}
    expected = _keys(SimulatorConfig, "simulator")
    for name, field in Settings.model_fields.items():
        nested = configdoc._model_in(field.annotation)
        if name != "simulator" and nested is not None:
            expected |= _keys(nested[0], name + nested[1])
    assert set(rows) == expected
    for row in rows.values():
        leaf = row.key.rsplit(".", 1)[-1]
        assert len(row.description.split()) >= 3 and row.description != leaf, row


def test_rows_show_type_default_and_bounds() -> None:
    rows = {r.key: r for s in configdoc.sections() for r in s.rows}
    assert rows["controller.min_weight"].default == "`0.02`"
    assert rows["controller.max_weight_step"].bounds == "> 0, ≤ 1"
    assert rows["model.name"].default == "required"
    assert rows["proxy.admission.max_inflight_kv_bytes"].default == "`68719476736` (64 GiB)"
    assert rows["proxy.policy"].type == "`weighted` \\| `round-robin`"
    assert rows["controller.trusted_span_senders"].bounds == "each length ≥ 1, each length ≤ 64"
    # a nested model with a required field shows its whole default; one without, its rows
    assert rows["slo.ttft"].default == "`{target_ms: 2000, percentile: 99}`"
    assert rows["proxy.timeouts"].default == "see below"
    assert rows["simulator.latency_scale"].bounds == "≥ 0"
    assert "pools.<name>.instances[].url" in rows


def test_a_field_without_description_is_an_error() -> None:
    class Bare(BaseModel):
        documented: int = Field(default=1, description="has one")
        bare: int = 2

    with pytest.raises(configdoc.UndocumentedField, match=r"Bare\.bare \(x\.bare\) has no description"):
        list(configdoc._rows(Bare, "x"))


def test_check_reports_a_stale_file_with_the_command(tmp_path, monkeypatch, capsys) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(configdoc, "DOC_PATH", stale)
    assert configdoc.main(["--check"]) == 1
    assert configdoc.COMMAND in capsys.readouterr().err
    assert configdoc.main(["--write"]) == 0
    assert stale.read_text(encoding="utf-8") == configdoc.render()
    assert configdoc.main(["--check"]) == 0


def test_print_writes_nothing(tmp_path, monkeypatch, capsys) -> None:
    target = tmp_path / "configuration.md"
    monkeypatch.setattr(configdoc, "DOC_PATH", target)
    assert configdoc.main([]) == 0
    assert capsys.readouterr().out == configdoc.render()
    assert not target.exists()


def test_write_outside_a_checkout_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(configdoc, "DOC_PATH", tmp_path / "no-docs" / "configuration.md")
    assert configdoc.main(["--write"]) == 1
    assert "run it from a checkout" in capsys.readouterr().err
