"""pdscope collector (see ARCHITECTURE in README)."""
