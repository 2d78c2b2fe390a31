"""starling.node."""
