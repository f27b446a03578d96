"""The scheduler: a sans-IO core (core.py) that decides, and the drivers that do its I/O."""
