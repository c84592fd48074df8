"""The ``collector`` section: the scraper, the OTLP receiver and its durable spool."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from pdscope.config.access import parse_named_tokens
from pdscope.config.base import ConfigError, NonEmpty, NonNegative, Port, PositiveFloat, PositiveInt
from pdscope.config.httpserver import _HTTPServerSettings


class CollectorSettings(_HTTPServerSettings):
    host: str = "127.0.0.1"
    """address of the OTLP/HTTP receiver, /metrics and /healthz; a non-loopback one needs OTLP tokens"""
    port: Port = 4318
    """port of the OTLP/HTTP receiver, /metrics and /healthz"""
    id: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$"
    )
    """this collector's id among the collectors sharing a PostgreSQL store, which split the instances to
    scrape between them; unique per process. Unset: <hostname>:<receiver port>"""
    scrape_interval_s: PositiveFloat = 5.0
    """seconds between scrapes of every instance's /metrics (or Prometheus queries)"""
    scrape_timeout_s: PositiveFloat = 3.0
    """hard deadline of one scrape (connect, headers and body); must be shorter than scrape_interval_s"""
    max_body_bytes: PositiveInt = 8 * 2**20
    """a /metrics page is cut here (a Prometheus answer at 8 x this)"""
    prometheus_url: str | None = None
    """read vLLM's series from this Prometheus (/api/v1/query) instead of scraping; also pdscope collect
    --prometheus-url"""
    prometheus_instance_label: NonEmpty = "instance"
    """Prometheus label holding the pdscope instance name or the metrics URL's host:port"""
    prometheus_selector: str = ""
    """label matchers added to every Prometheus query, e.g. job=\"vllm\""""
    otlp_tokens_env: NonEmpty = "PDSCOPE_OTLP_TOKENS"
    """name of the env variable holding sender:token[,sender:token...] for POST /v1/traces; unset: no
    authentication, and the collector binds only a loopback host"""
    otlp_max_body_bytes: PositiveInt = 16 * 2**20
    """largest OTLP body as sent (or by Content-Length); larger: 413"""
    otlp_max_inflated_bytes: PositiveInt = 64 * 2**20
    """largest OTLP body after gzip/deflate decompression; larger: 413"""
    otlp_inflight_bytes: PositiveInt = 128 * 2**20
    """OTLP bytes (as sent plus inflated) held by all requests at once; past it: 429"""
    otlp_retry_after_s: int = Field(default=1, ge=1, le=3600)
    """Retry-After of a 429/503"""
    span_queue_spans: PositiveInt = 200_000
    """spans waiting for the store held decoded in memory; past it they wait on disk only (with spool_dir
    ':memory:' this is the spool's bound: a full spool answers 503)"""
    spool_dir: str | None = Field(default=None, min_length=1)
    """folder of the durable span spool: every accepted OTLP export is written here before its 2xx and kept
    until the store has it, so a store outage loses nothing; one collector process per folder. Unset: <temp
    dir>/pdscope-spool/<hash of store url and collector id> (survives a restart of the process, not of the
    host: set a persistent volume in production). ':memory:': in memory only (lost when the process stops)"""
    spool_max_bytes: int = Field(default=2**30, ge=2**20)
    """bytes of span batches the spool holds for the store; past it OTLP exports get 503 with Retry-After
    (never 2xx and dropped). Disk use can exceed it by one segment"""
    spool_max_age_s: PositiveFloat = 3600.0
    """while the spool's oldest batch has waited longer than this for the store, new exports get 503 with
    Retry-After"""
    spool_fsync: Literal["always", "never"] = "always"
    """always: each export is fsynced before its 2xx (survives a host crash); never: left to the OS (survives
    the collector's crash or kill, not the host's)"""
    spool_segment_bytes: int = Field(default=64 * 2**20, ge=2**16)
    """size of one spool file; a file goes once the store has all of it"""
    span_max_attributes: int = Field(default=128, gt=0, le=10_000)
    """attribute keys kept per span"""
    span_max_value_chars: PositiveInt = 2048
    """longest attribute string kept"""
    span_max_attribute_chars: PositiveInt = 32 * 1024
    """all of a span's attributes together, serialised"""
    span_max_future_s: NonNegative = 300.0
    """spans starting or ending further ahead of the collector's clock than this are dropped (in_future)"""

    @model_validator(mode="after")
    def _timeout_below_interval(self) -> CollectorSettings:
        if self.scrape_timeout_s >= self.scrape_interval_s:
            raise ValueError("scrape_timeout_s must be shorter than scrape_interval_s")
        if self.otlp_max_inflated_bytes < self.otlp_max_body_bytes:
            raise ValueError("otlp_max_inflated_bytes must be at least otlp_max_body_bytes")
        if self.otlp_inflight_bytes < self.otlp_max_body_bytes + self.otlp_max_inflated_bytes:
            raise ValueError(
                "otlp_inflight_bytes must hold one largest request: "
                "otlp_max_body_bytes + otlp_max_inflated_bytes"
            )
        return self

    def otlp_tokens(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """token -> sender, from ``$otlp_tokens_env``; empty when unset (no authentication).

        Raises ConfigError naming the variable when an entry is not ``sender:token``.
        """
        raw = (os.environ if environ is None else environ).get(self.otlp_tokens_env, "")
        try:
            by_sender = parse_named_tokens(raw, self.otlp_tokens_env)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from exc
        return {token: sender for sender, token in by_sender.items()}
