"""`python -m rollstream.cli` = the `rollstream` command."""

from rollstream.cli import main

raise SystemExit(main())
