"""The Qt panels and docks, one per file, each given its source or model."""
