"""nbtrain.engine."""
