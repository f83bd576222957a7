"""Developer tools that are not part of the runtime: `python -m xdit_lab.tools.notebooks NOTEBOOK...`."""
