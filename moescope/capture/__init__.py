"""Capture: the observer seam and the probes that accumulate routing statistics on the device."""

from moescope.capture.observer import NOOP, FanOut, Observer, RuntimeObserver

__all__ = ["NOOP", "FanOut", "Observer", "RuntimeObserver"]
