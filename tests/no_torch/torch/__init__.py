"""On PYTHONPATH of the fault-injection CLI runs: torch is absent there, as in a runtime install without extras."""

raise ImportError("torch is not installed in this environment")
