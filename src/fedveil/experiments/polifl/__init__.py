"""PoliFL: the compliance-strategy runner (`fedveil polifl run`), Table 4 and the scaling study."""
