"""starling.tasks."""
