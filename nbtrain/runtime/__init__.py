"""nbtrain.runtime."""
