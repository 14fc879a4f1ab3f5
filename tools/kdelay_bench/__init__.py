"""kdelay's benchmarks (``tools/bench``): figures against a plain pipe, not tests."""
