"""nbtrain.ui."""
