"""Readable reports of what sharding did: plan tables, node listings, graph pictures and graph diffs."""
