"""The `rollstream` command: the parser and dispatch in rollstream.cli.main (entry point
`rollstream.cli.main:main`), the commands in the `*_cmds` modules beside it."""
