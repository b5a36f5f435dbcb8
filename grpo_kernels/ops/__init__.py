"""The row backends of the logits path and the tile backends of the fused-linear path (ops/rows.py: their interfaces)."""
