"""Data layer: readers -> standardize -> normalize -> mixture -> loader (lower layers never import higher ones)."""
