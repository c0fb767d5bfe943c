"""A `serve` job: stage actors on nodes that hold the model (`stages.py`) behind the OpenAI-compatible API (`runner.py`)."""
