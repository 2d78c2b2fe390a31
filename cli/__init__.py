"""starling.cli."""
