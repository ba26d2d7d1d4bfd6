"""Building blocks shared by the embodied model families."""
