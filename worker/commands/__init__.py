"""One module per ``tokenfleet`` subcommand run by a worker host."""
