"""The SLOs & alerts page counts only the records the controller believes: with
``controller.trusted_span_senders`` set, a record forged by another sender (or by none) is left out of
the headline, the sample and the buckets, as ``/v1/slo/attribution`` and the controller leave it out."""

from __future__ import annotations

import pytest
import yaml
from sqlalchemy import func, select, update

from dashboard.queries import records
from dashboard.queries.common import Window
from store.attribution import trusted_records
from store.db import make_engine
from store.models import RequestRecord
from tests.dashboard.conftest import Seeded, make_seeded
from tests.dashboard.test_pages import open_page


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Seeded, int, int]:
    """A seeded store whose every third record came from the proxy's token and the rest from a leaked
    one (``vllm``) or none; the config trusts ``proxy`` only. ``(seeded, trusted, all)``."""
    seeded = make_seeded(tmp_path_factory.mktemp("forged"), requests=600, duration_s=600.0)
    engine = make_engine(seeded.url)
    with engine.begin() as conn:
        conn.execute(update(RequestRecord).where(RequestRecord.id % 3 == 0).values(sender="proxy"))
        conn.execute(update(RequestRecord).where(RequestRecord.id % 3 == 1).values(sender="vllm"))
        trusted = conn.scalar(select(func.count()).where(RequestRecord.sender == "proxy")) or 0
        every = conn.scalar(select(func.count()).select_from(RequestRecord)) or 0
    engine.dispose()
    data = yaml.safe_load(seeded.config.read_text())
    data.setdefault("controller", {})["trusted_span_senders"] = ["proxy"]
    seeded.config.write_text(yaml.safe_dump(data, sort_keys=False))
    assert 0 < trusted < every
    return seeded, trusted, every


def test_the_slo_page_leaves_out_records_from_untrusted_senders(
    forged: tuple[Seeded, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded, trusted, every = forged
    at = open_page(seeded.config, "slos", monkeypatch)
    counted = next(m.value for m in at.metric if m.label == "requests")
    assert counted == f"{trusted:,}", (counted, trusted, every)  # was every record, forged ones too


def test_the_queries_read_only_what_the_filter_keeps(forged: tuple[Seeded, int, int]) -> None:
    seeded, trusted, every = forged
    engine = make_engine(seeded.url)
    window = Window(seeded.spec.end - seeded.spec.duration_s - 60, seeded.spec.end + 60)
    only = trusted_records(["proxy"])
    assert records.count(engine, window) == every
    assert records.count(engine, window, only) == trusted
    sample, step = records.sample(engine, window, only=only)
    assert step == 1 and len(sample) == trusted
    assert int(records.slo_buckets(engine, window, 60.0, only=only)["arrivals"].sum()) == trusted
    assert int(records.slo_buckets(engine, window, 60.0)["arrivals"].sum()) == every
    engine.dispose()
