"""Model definitions, one file per architecture, found through `registry`."""
