"""starling.protocols."""
