"""pdscope collector: scraper, OTLP receiver and request-record builder (see docs/collector.md)."""
