"""The `rollstream` command; its code is in rollstream.cli.main (entry point `rollstream.cli.main:main`)."""
