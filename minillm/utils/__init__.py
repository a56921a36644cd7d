"""Plumbing shared by the course: the notebooks' diagrams (diagram.py) and the type tests every boundary makes (validate.py)."""
