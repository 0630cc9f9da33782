"""onegemm.persistent (see README.md)."""
