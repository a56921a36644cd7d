"""Plumbing shared by the course: the notebooks' diagrams and the checks every boundary makes."""
