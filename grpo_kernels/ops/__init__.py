"""The row backends of the logits path and the tile backends of the fused-linear path (ops/backend.py: their
interfaces; ops/linear_tiles.py: the tile driver)."""
