"""tallow.compiler."""
