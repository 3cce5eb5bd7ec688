"""Command-line subcommands; see superoffload.cli."""
