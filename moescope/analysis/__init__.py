"""Offline analysis over recorded routing: cache what-if, reports, placement planning."""
