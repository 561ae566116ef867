"""``python -m ddiloco.workers learner|syncer|evaluator ...``: one worker process."""

from ddiloco.workers.cli import main

main()
