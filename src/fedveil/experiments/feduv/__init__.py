"""FedUV: Table 3's runner (`fedveil feduv run`)."""
