"""tallow.server."""
