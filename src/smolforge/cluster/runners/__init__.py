"""Job runners: one thread per active job, one runner class per job kind (see smolforge.cluster.jobs)."""
