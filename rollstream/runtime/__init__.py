"""What every process of a run stands on: a worker's start-up (`process`: argv -> config, logging, two-stage
SIGTERM, exit codes, a Redis client), files written atomically into private folders (`files`), and Linux
/proc reads (`procfs`)."""
