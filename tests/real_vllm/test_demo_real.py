"""`pdscope demo --real-vllm` against the session's real CPU pair (issue 13): it starts, its
load generator's requests are recorded with vLLM's own spans joined, an earlier run's
store is moved aside, and Ctrl-C (SIGINT) leaves no process behind.

The demo attaches to the running pair (``--prefill-url``/``--decode-url``) instead of
starting a second one; the pair's spans reach the demo's collector through the session's
OTLP sink (``forward_to``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from store.db import make_engine, session_factory
from store.models import RequestRecord
from tests.processes import processes_mentioning
from tests.real_vllm.conftest import RealPD
from tests.support.sockets import free_ports
from tests.support.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.real_vllm

REPO = Path(__file__).resolve().parents[2]


def _joined_records(store_url: str, p_name: str, d_name: str) -> list[RequestRecord]:
    """Completed records that carry fields only vLLM's spans provide (queue times on P and D)."""
    engine = make_engine(store_url)
    try:
        with session_factory(engine)() as s:
            return list(
                s.scalars(
                    select(RequestRecord).where(
                        RequestRecord.p_instance == p_name,
                        RequestRecord.d_instance == d_name,
                        RequestRecord.status == "ok",
                        RequestRecord.p_queue_s.is_not(None),
                        RequestRecord.d_queue_s.is_not(None),
                        RequestRecord.d_decode_s.is_not(None),
                    )
                )
            )
    except SQLAlchemyError:  # the store may not have its tables yet: nothing recorded
        return []
    finally:
        engine.dispose()


def test_real_vllm_demo_records_joined_requests_and_ctrl_c_cleans_up(real_pd: RealPD, tmp_path: Path) -> None:
    proxy_port, controller_port, collector_port, dashboard_port = free_ports(4)
    base = tmp_path / "demo-base.yaml"
    base.write_text(
        yaml.safe_dump(
            real_pd.config_dict(
                proxy={"port": proxy_port},
                controller={"port": controller_port, "interval_s": 1},
                collector={"port": collector_port, "scrape_interval_s": 1, "scrape_timeout_s": 0.8},
                dashboard={"port": dashboard_port},
            ),
            sort_keys=False,
        )
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "pdscope.db").write_bytes(b"an earlier demo's store")  # must not be mixed into this run
    store_url = f"sqlite:///{(workdir / 'pdscope.db').resolve()}"

    real_pd.otlp.forward_to = f"http://127.0.0.1:{collector_port}/v1/traces"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdscope.cli",
            "--log-level",
            "WARNING",
            "--config",
            str(base),
            "demo",
            "--real-vllm",
            "--prefill-url",
            real_pd.prefill_url,
            "--decode-url",
            real_pd.decode_url,
            "--workdir",
            str(workdir),
            "--no-dashboard",
            "--fault-after",
            "-1",
            "--duration",
            "600",
            "--rate",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:

        def joined() -> list[RequestRecord]:
            assert proc.poll() is None, f"the demo exited early ({proc.returncode}):\n" + "\n".join(lines)
            return _joined_records(store_url, real_pd.prefill_name, real_pd.decode_name)

        try:
            records = wait_until(
                "3 requests recorded with vLLM's spans joined",
                joined,
                done=lambda rs: len(rs) >= 3,
                timeout_s=300,
                every_s=1.0,
            )
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}:\n" + "\n".join(lines)) from None
        out = "\n".join(lines)
        assert proc.poll() is None, f"the demo exited early ({proc.returncode}):\n{out}"
        assert "DIED" not in out, out
        assert f"http://127.0.0.1:{proxy_port}" in out, out
        assert len(records) >= 3, f"no requests recorded with vLLM's spans joined:\n{out}"
        rec = records[0]
        assert rec.attributes and str(rec.attributes.get("d_vllm_request_id", "")).startswith("cmpl-"), (
            rec.attributes
        )
        assert rec.completion_tokens == 16  # the demo's --output-len fixed:16 reached vLLM
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        reader.join(timeout=5)
        real_pd.otlp.forward_to = None
    out = "\n".join(lines)
    assert "stopped." in out, out
    assert (workdir / "previous" / "pdscope.db").read_bytes() == b"an earlier demo's store"
    assert "fresh store" in out
    # children were reaped by the demo; /proc may lag a moment
    wait_until(
        "no process left behind after Ctrl-C",
        lambda: processes_mentioning(str(workdir)),
        done=lambda pids: pids == [],
        timeout_s=15,
        every_s=0.5,
    )
    # the pair the demo attached to is not the demo's to stop
    assert real_pd.pair.prefill.proc is not None and real_pd.pair.prefill.proc.poll() is None
    assert real_pd.pair.decode.proc is not None and real_pd.pair.decode.proc.poll() is None
