"""starling.compressors."""
