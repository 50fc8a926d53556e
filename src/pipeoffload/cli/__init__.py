"""The `pipeoffload` command line: parsers, up-front checks and one short function per
subcommand over the library's public API (nothing in the library imports this package)."""
