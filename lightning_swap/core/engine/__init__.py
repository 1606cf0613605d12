"""Act's and measure's shared primitives: the stream protocol, the host pool, the device meter,
recomputation, the offload engine and unified memory. Imports the vocabulary only."""
