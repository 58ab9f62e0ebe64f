"""`radixlm router`: an HTTP front over several `radixlm serve` replicas, routing each request to the
replica that most likely has its prefix cached (docs/scale_out.md)."""
