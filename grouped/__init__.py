"""onegemm.grouped (see README.md)."""
