"""pdscope dashboard (see ARCHITECTURE in README)."""
