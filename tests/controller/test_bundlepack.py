"""The bundle's contents, pure: names, bounds (rows and bytes), the manifest, redaction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller.bundlepack import (
    MANIFEST_RESERVE,
    BundleTooLarge,
    Contents,
    TableRead,
    Trigger,
    alert_bundle_name,
    dumps,
    is_bundle_name,
    pack,
    pack_table,
    pack_tables,
    range_bundle_name,
    redact,
)

T0 = 1_796_181_300.0  # 2026-12-02 03:15:00 UTC


def rows(n: int, width: int = 10, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": start + k, "ts": T0 + k, "pad": "x" * width} for k in range(n)]


def line_bytes(row: dict[str, Any]) -> int:
    return len(dumps(row)) + 1


@pytest.mark.parametrize(
    ("rule", "labels", "want"),
    [
        (
            "KVLeaseExpired",
            {"instance": "prefill-0"},
            "pdscope-KVLeaseExpired-prefill-0-20261202T031500Z.tar.gz",
        ),
        ("InstanceDown", {"pool": "decode"}, "pdscope-InstanceDown-decode-20261202T031500Z.tar.gz"),
        ("TTFTOverTarget", {}, "pdscope-TTFTOverTarget-fleet-20261202T031500Z.tar.gz"),
        (
            "KVLeaseExpired",
            {"instance": "../../etc/p w"},
            "pdscope-KVLeaseExpired-etc_p_w-20261202T031500Z.tar.gz",
        ),
    ],
)
def test_alert_names_are_safe_file_names(rule: str, labels: dict[str, str], want: str) -> None:
    name = alert_bundle_name(rule, labels, T0)
    assert name == want and is_bundle_name(name)


def test_range_names_and_what_is_not_a_bundle_name() -> None:
    assert range_bundle_name(T0 - 1800, T0) == "pdscope-range-20261202T024500Z-20261202T031500Z.tar.gz"
    for bad in (
        "../pdscope-x.tar.gz",
        ".pdscope-x.tar.gz.abc.tmp",
        "pdscope-x.zip",
        "pdscope-a/b.tar.gz",
        "x",
    ):
        assert not is_bundle_name(bad), bad


def test_a_table_under_its_budget_is_whole() -> None:
    t = TableRead("records", rows(5), total=5)
    p = pack_table(t, 10_000)
    assert (p.included, p.byte_cut) == (5, False)
    assert [json.loads(x)["id"] for x in p.data.splitlines()] == [0, 1, 2, 3, 4]
    assert p.notes() == []


def test_over_budget_the_newest_rows_that_fit_are_kept_oldest_first() -> None:
    rs = rows(10)
    t = TableRead("records", rs, total=10)
    budget = 3 * line_bytes(rs[0]) + 1
    p = pack_table(t, budget)
    assert len(p.data) <= budget and p.included == 3 and p.byte_cut
    assert [json.loads(x)["id"] for x in p.data.splitlines()] == [7, 8, 9]
    assert p.notes() == ["records: cut to fit max_bytes: the newest 3 of 10 rows kept"]


def test_a_sampled_table_says_so() -> None:
    t = TableRead("snapshots", rows(4), total=40, every=10)
    p = pack_table(t, 10_000)
    assert p.entry()["sampled_every"] == 10 and p.entry()["rows_in_window"] == 40
    assert p.notes() == [
        "snapshots: 40 rows in the window, over max_records: 1 row in every 10 was kept (4 rows)"
    ]


def test_tables_share_the_budget_small_ones_whole_large_ones_take_the_rest() -> None:
    small = TableRead("alerts", rows(2), total=2)
    big_a = TableRead("records", rows(200, width=50), total=200)
    big_b = TableRead("snapshots", rows(100, width=50), total=100)
    budget = 8000
    packed = pack_tables([small, big_a, big_b], budget)
    by = {p.name: p for p in packed}
    assert [p.name for p in packed] == ["alerts", "records", "snapshots"]  # the order given
    assert by["alerts"].included == 2 and not by["alerts"].byte_cut
    assert by["records"].byte_cut and by["snapshots"].byte_cut
    total = sum(len(p.data) for p in packed)
    assert total <= budget
    # what the small table left is shared: each large one gets about half of the rest
    rest = budget - len(by["alerts"].data)
    longest = max(line_bytes(r) for r in [*big_a.rows, *big_b.rows])
    assert len(by["snapshots"].data) > rest // 2 - longest
    assert len(by["records"].data) > rest - len(by["snapshots"].data) - longest


def test_a_budget_of_nothing_keeps_no_row() -> None:
    p = pack_tables([TableRead("records", rows(3), total=3)], 0)[0]
    assert p.included == 0 and p.data == b"" and p.byte_cut


def _contents(**kw: Any) -> Contents:
    base: dict[str, Any] = dict(
        name="pdscope-KVLeaseExpired-prefill-0-20261202T031500Z.tar.gz",
        lo=T0 - 900,
        hi=T0,
        created_at=T0 + 1,
        trigger=Trigger(
            "KVLeaseExpired", "fp", {"instance": "prefill-0"}, "warning", "2 expired", 2.0, T0, T0
        ),
        tables=[
            TableRead(n, rows(3), total=3)
            for n in ("alerts", "decisions", "overrides", "records", "snapshots")
        ],
        report=lambda notes: "<html>" + "".join(f"<li>{n}</li>" for n in notes) + "</html>",
        attribution={"requests": 3},
        settings={"store": {"url": "sqlite:///x.db"}},
        policy_configs=[{"fingerprint": "v1:abc", "config": {}}],
        max_records=100,
        max_bytes=2**20,
    )
    base.update(kw)
    return Contents(**base)


def test_pack_lays_out_the_members_under_one_folder_with_a_manifest_first() -> None:
    members = pack(_contents())
    names = [n for n, _ in members]
    folder = "pdscope-KVLeaseExpired-prefill-0-20261202T031500Z"
    assert names[0] == f"{folder}/manifest.json"
    assert {n.split("/", 1)[1] for n in names} == {
        "manifest.json",
        "report.html",
        "attribution.json",
        "settings.json",
        "policy_configs.json",
        "alerts.jsonl",
        "decisions.jsonl",
        "overrides.jsonl",
        "records.jsonl",
        "snapshots.jsonl",
    }
    assert all(n.startswith(folder + "/") for n in names)
    man = json.loads(members[0][1])
    assert man["format"] == "pdscope-bundle" and man["reason"] == "alert"
    assert (
        man["trigger"]["alertname"] == "KVLeaseExpired"
        and man["trigger"]["fired_at_iso"] == "2026-12-02T03:15:00Z"
    )
    assert man["window"] == {
        "from": T0 - 900,
        "until": T0,
        "from_iso": "2026-12-02T03:00:00Z",
        "until_iso": "2026-12-02T03:15:00Z",
    }
    assert man["truncated"] is False and man["notes"] == [] and man["policy_configs"] == ["v1:abc"]
    sizes = {m["name"]: m["bytes"] for m in man["members"]}
    assert sizes == {n.split("/", 1)[1]: len(b) for n, b in members[1:]}


def test_pack_stays_under_max_bytes_and_the_manifest_says_what_was_cut() -> None:
    big = [TableRead("records", rows(20_000, width=100), total=50_000, every=3)]
    c = _contents(tables=big, max_bytes=2**20, trigger=None)
    members = pack(c)
    assert sum(len(b) for _, b in members) <= c.max_bytes
    man = json.loads(members[0][1])
    assert man["reason"] == "range" and man["trigger"] is None and man["truncated"] is True
    entry = man["tables"]["records"]
    assert entry["rows_in_window"] == 50_000 and entry["rows_read"] == 20_000 and entry["sampled_every"] == 3
    assert entry["cut_to_fit_bytes"] is True and 0 < entry["rows_included"] < 20_000
    assert any("1 row in every 3" in n for n in man["notes"])
    assert any("cut to fit max_bytes" in n for n in man["notes"])
    report = dict(members)[f"{c.name.removesuffix('.tar.gz')}/report.html"].decode()
    assert all(f"<li>{n}</li>" in report for n in man["notes"]), "the report lists every cut"


def test_fixed_members_over_max_bytes_are_refused() -> None:
    with pytest.raises(BundleTooLarge, match="max_bytes 1048576 is too small"):
        pack(_contents(report=lambda notes: "x" * (2**20 - MANIFEST_RESERVE)))


def test_json_is_strict() -> None:
    assert json.loads(dumps({"a": float("nan"), "b": float("inf"), "c": (1, 2), "d": b"x"})) == {
        "a": None,
        "b": None,
        "c": [1, 2],
        "d": "b'x'",
    }


def test_redact_masks_passwords_in_urls_only() -> None:
    got = redact(
        {
            "store": {"url": "postgresql://pd:s3cret@db.example:5432/pdscope"},
            "hook": "https://user:tok@hooks.example/x?y=1",
            "plain": "sqlite:///pdscope.db",
            "mail": "me@example.com",
            "list": ["http://a:b@c"],
        }
    )
    assert got == {
        "store": {"url": "postgresql://pd:***@db.example:5432/pdscope"},
        "hook": "https://user:***@hooks.example/x?y=1",
        "plain": "sqlite:///pdscope.db",
        "mail": "me@example.com",
        "list": ["http://a:***@c"],
    }
