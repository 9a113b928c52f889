"""HTTP routes of the bridge, one module per resource."""
