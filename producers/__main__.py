"""`python -m producers pipeline.yaml [key=value ...] [--name rollout_NN] [--burst] [--max-dispatches N]`."""

from producers.worker import main

raise SystemExit(main())
