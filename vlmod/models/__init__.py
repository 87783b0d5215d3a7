"""Models built offline: tiny random ones for tests and recipes, 7B-shaped ones for the size check."""
