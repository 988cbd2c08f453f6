"""Command-line entry points (`python -m launch.<name>`): parse flags, call a library function."""
