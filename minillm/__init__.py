"""minillm."""
