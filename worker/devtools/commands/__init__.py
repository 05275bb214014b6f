"""``tokenfleet`` subcommands for demos and development: demo, make-tiny-model, bench."""
