"""Real data for the tasks: sources that yield documents, tokenizers, token stores that pack
them into fixed-length rows, a background prefetcher, and the rule that says which units of an
epoch each member of a swarm trains (`assignment`)."""
