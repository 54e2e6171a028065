"""The worker: one model replica on this process's device (``worker.Worker``)."""
