"""PPFL: the layer-wise runner (`fedveil ppfl run`), its attack table, LiRA, transfer and cost studies."""
