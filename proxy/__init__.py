"""pdscope proxy (see ARCHITECTURE in README)."""
