"""Views of a plan for people: node topology, tables and an SVG picture (no torch)."""
