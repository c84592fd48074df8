"""pdscope controller (see ARCHITECTURE in README)."""
