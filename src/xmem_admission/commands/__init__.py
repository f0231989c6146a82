"""One module per ``xmem`` subcommand; each exposes ``register(subparsers)`` and imports nothing heavy."""
