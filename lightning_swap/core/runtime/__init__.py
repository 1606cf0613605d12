"""Act: the runtime that applies a plan to a model, its per-step statistics and measured rows."""
