"""onegemm.blockscaled (see README.md)."""
