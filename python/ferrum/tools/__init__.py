"""Developer tools that need no compiled extension: the test-model generator and its quantizers."""
