"""tallow.runtime."""
