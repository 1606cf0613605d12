"""Scale: the session adapters drive, ``policy="auto"``'s decisions, and the batch-size searches."""
