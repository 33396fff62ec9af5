"""Command-line interface: imports everything, imported by nothing."""
