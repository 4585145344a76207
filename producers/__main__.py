"""`python -m producers pipeline.yaml [key=value ...] [--name rollout_NN] [--burst] [--max-dispatches N]`."""

from rollstream.worker import install_early_signal_handlers

install_early_signal_handlers()  # before torch is imported

from producers.worker import main  # noqa: E402

raise SystemExit(main())
