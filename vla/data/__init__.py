"""Data layer: readers -> standardize -> normalize -> mixture -> loader (DESIGN §2)."""
