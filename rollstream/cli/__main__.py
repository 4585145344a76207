"""`python -m rollstream.cli` = the `rollstream` command."""

from rollstream.cli.main import main

raise SystemExit(main())
