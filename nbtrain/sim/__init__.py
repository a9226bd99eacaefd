"""Discrete-event cluster simulator driving the same ``nbtrain.core`` scheduler."""
