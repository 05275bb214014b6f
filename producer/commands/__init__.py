"""``tokenfleet`` subcommands that need only the base install."""
