"""The `shipyard` command: one module per command group, each parser next to its handler (main.py dispatches)."""
