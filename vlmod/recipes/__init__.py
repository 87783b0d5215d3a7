"""End-to-end runs anyone can repeat: the synthetic recipes and the real-size check."""
