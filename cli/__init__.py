"""tallow.cli."""
