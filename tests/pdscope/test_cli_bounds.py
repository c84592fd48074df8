"""Every command-line number that sizes memory or time, the fit's parameters and the API's time query
fields are bounded: NaN, infinities and values out of range are refused naming the parameter (CLI: exit
2 and ``pdscope <cmd>: --flag: ...``; fit: ``FitError`` naming it). The API's fields:
``tests/controller/test_api_bounds.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdscope import cli
from simulator.fit import FitError, FitParams, RequestObs, fit

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "pdscope.yaml")

CLI_CASES = [
    ("whatif", ("--since", "30m", "--bucket-s", "1e-5"), "--bucket-s"),
    ("whatif", ("--since", "30m", "--bucket-s", "nan"), "--bucket-s"),
    ("whatif", ("--since", "30m", "--bucket-s", "inf"), "--bucket-s"),
    ("whatif", ("--since", "30m", "--bucket-s", "1e9"), "--bucket-s"),
    ("whatif", ("--since", "7d", "--bucket-s", "1"), "--bucket-s"),  # 604,800 buckets: over the cap
    ("whatif", ("--since", "30m", "--max-replay-s", "1e12"), "--max-replay-s"),
    ("whatif", ("--since", "30m", "--tolerance", "nan"), "--tolerance"),
    ("whatif", ("--from", "nan", "--until", "10"), "--from"),
    ("explain", ("--limit", "0"), "--limit"),
    ("explain", ("--limit", "100000000"), "--limit"),
    ("explain", ("--misses", "-1"), "--misses"),
    ("explain", ("--until", "inf", "--since", "1h"), "--until"),
    ("bundle", ("--since", "1h", "--max-records", "0"), "--max-records"),
    ("bundle", ("--since", "1h", "--max-bytes", "100000000000"), "--max-bytes"),
    ("replay", ("--from=-inf", "--until", "10"), "--from"),
    ("demo", ("--rate", "1e9"), "--rate"),
    ("demo", ("--duration", "nan"), "--duration"),
    ("demo", ("--fault-after", "inf"), "--fault-after"),
]


@pytest.mark.parametrize(("command", "args", "flag"), CLI_CASES, ids=[f"{c}{a}" for c, a, _ in CLI_CASES])
def test_a_number_out_of_bounds_is_a_usage_error_naming_the_option(
    command: str, args: tuple[str, ...], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = (
        ("--store", f"sqlite:///{tmp_path / 's.db'}") if command != "demo" else ("--workdir", str(tmp_path))
    )
    assert cli.main(["--config", CONFIG, command, *store, *args]) == 2
    err = capsys.readouterr().err
    assert f"pdscope {command}: {flag}: " in err, err
    assert not (tmp_path / "s.db").exists()  # refused before the store was opened


def _obs(at: float) -> RequestObs:
    return RequestObs(arrival=at, status="ok")


FIT_CASES = [
    ({"bucket_s": 1e-5}, "bucket_s"),
    ({"bucket_s": float("nan")}, "bucket_s"),
    ({"bucket_s": float("inf")}, "bucket_s"),
    ({"degraded_ratio": float("nan")}, "degraded_ratio"),
    ({"min_samples": 0}, "min_samples"),
    ({"low_quantile": 2.0}, "low_quantile"),
    ({"normal_quantile": -0.5}, "normal_quantile"),
    ({"min_spell_s": float("inf")}, "min_spell_s"),
]


@pytest.mark.parametrize(("params", "name"), FIT_CASES, ids=[n for _, n in FIT_CASES])
def test_the_fits_parameters_are_bounded(params: dict[str, float], name: str) -> None:
    with pytest.raises(FitError, match=rf"^{name}: "):
        fit([_obs(1.0)], {"p": "prefill", "d": "decode"}, 0.0, 1800.0, params=FitParams(**params))  # type: ignore[arg-type]


def test_the_fits_bucket_count_is_capped() -> None:
    with pytest.raises(FitError, match=r"^bucket_s: .* over 100000 buckets"):
        fit([_obs(1.0)], {"p": "prefill", "d": "decode"}, 0.0, 7 * 86_400.0, params=FitParams(bucket_s=1.0))
