"""pdscope simulator (see ARCHITECTURE in README)."""
