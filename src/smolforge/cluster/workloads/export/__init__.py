"""An `export` job: one task on a node that holds the model (`runner.py`)."""
